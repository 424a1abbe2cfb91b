"""What bfloat16 accumulators cost in exactness, as windows grow.

A keras_hub GPT-2 causal LM with a tiny random config (2 layers, hidden 64,
no dropout, ~90k weights) learns bytes of real text (the Python standard
library's own source, which ships with every Python: nothing is downloaded),
micro-batches of 4 sequences of 32 bytes, AdamW. For each window length N it
trains the same `--updates` optimizer updates from the same weights and
data: float32 accumulators (the reference), bfloat16 accumulators rounded to
nearest at each micro-step, and bfloat16 accumulators as tfaccum keeps them
(summed in float32 each micro-step, rounded stochastically). A fourth run
sets the floor: float32 accumulators with each window's micro-batches added
in reverse order, the same large batches rounded differently (training
amplifies any difference; this is how far rounding alone carries it). Each
run is compared with the float32 one: the relative distance of the weights
(|w - w32| / |w32|, over all weights), and of the loss curve (mean absolute
difference of the per-update loss over the last half of training, relative
to the float32 loss there). `--seeds` repeats the stochastic rounding with
other seeds (the spread; the other runs are deterministic).

    python benchmarks/precision.py [--windows 4,16,64] [--updates 100] [--seeds 3]
"""

import argparse
import inspect
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfaccum  # noqa: E402
from tfaccum.backend.tensorflow import precision  # noqa: E402

SEQUENCE, MICRO = 32, 4


def text_bytes():
    """Bytes of real text that every Python installation holds."""
    import argparse as a
    import json
    import pathlib
    return np.frombuffer("".join(inspect.getsource(m) for m in (a, json, pathlib))
                         .encode("utf-8"), np.uint8)


def batches(updates, steps):
    data = text_bytes().astype("int32")
    count = updates * steps * MICRO
    starts = np.random.default_rng(0).integers(0, len(data) - SEQUENCE - 1, count)
    x = np.stack([data[s:s + SEQUENCE] for s in starts])
    y = np.stack([data[s + 1:s + SEQUENCE + 1] for s in starts])
    return {"token_ids": x, "padding_mask": np.ones_like(x, bool)}, y


def build(steps):
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=256, num_layers=2, num_heads=2, hidden_dim=64,
        intermediate_dim=128, max_sequence_length=SEQUENCE, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.AdamW(3e-3, weight_decay=0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps)  # one call per window: less overhead
    return model


class UpdateLosses(keras.callbacks.Callback):
    """Each update's mean loss, from the running epoch mean Keras logs."""

    def __init__(self):
        super().__init__()
        self.ends, self.running = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch + 1)
        self.running.append(float(logs["loss"]))

    def per_update(self):
        ends = np.asarray(self.ends, float)
        totals = np.asarray(self.running) * ends
        return np.diff(totals, prepend=0.0) / np.diff(ends, prepend=0.0)


def reversed_windows(x, y, steps):
    """The same windows, their micro-batches in reverse order (the float32 floor)."""
    order = np.arange(len(y)).reshape(-1, steps, MICRO)[:, ::-1].ravel()
    return {k: v[order] for k, v in x.items()}, y[order]


def train(steps, updates, mode, seed):
    x, y = batches(updates, steps)
    if mode == "float32-reversed":
        x, y = reversed_windows(x, y, steps)
    model = build(steps)
    tf.random.set_seed(seed)
    original = precision.stochastic_round
    if mode == "bfloat16-nearest":
        precision.stochastic_round = lambda value: tf.cast(value, tf.bfloat16)
    losses = UpdateLosses()
    try:
        model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0, callbacks=[
            tfaccum.GradientAccumulationCallback(
                accumulation_steps=steps, noise_scale=False,
                accumulator_dtype="bfloat16" if mode.startswith("bfloat16") else "float32"),
            losses])
    finally:
        precision.stochastic_round = original
    per_update = losses.per_update()
    weights = np.concatenate([np.ravel(w) for w in model.get_weights()])
    return weights, per_update


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", default="4,16,64")
    parser.add_argument("--updates", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    print(f"GPT-2 causal LM (2 layers, hidden 64), micro-batch {MICRO} x {SEQUENCE} bytes, "
          f"AdamW, {args.updates} updates; distance from float32 accumulators: median "
          f"(min-max) over {args.seeds} rounding seeds", flush=True)
    print("| N | accumulators | weights, relative | loss curve, relative | final loss (float32) |")
    print("|---:|---|---:|---:|---:|")
    for steps in map(int, args.windows.split(",")):
        start = time.perf_counter()
        reference, reference_loss = train(steps, args.updates, "float32", 0)
        half = len(reference_loss) // 2
        for mode in ("float32-reversed", "bfloat16-nearest", "bfloat16"):
            weights, curves = [], []
            # Only the stochastic rounding draws: the others are deterministic.
            for seed in range(args.seeds if mode == "bfloat16" else 1):
                w, loss = train(steps, args.updates, mode, seed)
                weights.append(np.linalg.norm(w - reference) / np.linalg.norm(reference))
                curves.append(float(np.mean(np.abs(loss[half:] - reference_loss[half:]))
                                    / np.mean(reference_loss[half:])))
            label = {"float32-reversed": "float32, each window's micro-batches reversed",
                     "bfloat16-nearest": "bfloat16, rounded to nearest",
                     "bfloat16": "bfloat16, stochastic (tfaccum)"}[mode]
            print(f"| {steps} | {label} | {spread(weights)} | {spread(curves)} | "
                  f"{reference_loss[-1]:.3f} |", flush=True)
        print(f"<!-- N={steps}: {time.perf_counter() - start:.0f} s -->", flush=True)


def spread(values):
    values = sorted(values)
    if len(values) == 1:
        return f"{values[0]:.1e}"
    return f"{statistics.median(values):.1e} ({values[0]:.1e}-{values[-1]:.1e})"


if __name__ == "__main__":
    main()
