"""How far each way of training with micro-batches ends from the large batch.

Trains the same model from the same weights on the same data (not shuffled):
once with batch N*B (the reference), then with micro-batches of B using
tfaccum, Keras' `Optimizer(gradient_accumulation_steps=N)`, and no
accumulation. Prints the largest absolute weight difference to the reference.
The data size leaves a short last micro-batch and a partial window per epoch,
as real data sets do. A second table does the same for sequence losses over
padded sequences (lengths 1..10): an embedding mask, `ignore_class`, and the
same padding given as per-token weights, with tfaccum weighting micro-batches
by tokens (`reduction="auto"`, the default) and by samples.

    python benchmarks/exactness.py [--samples 100] [--micro-batch 8] [--steps 4]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfaccum import GradientAccumulationCallback  # noqa: E402

OPTIMIZERS = {
    "SGD": lambda **kw: keras.optimizers.SGD(0.05, **kw),
    "SGD momentum": lambda **kw: keras.optimizers.SGD(0.05, momentum=0.9, **kw),
    "Adam": lambda **kw: keras.optimizers.Adam(0.01, **kw),
    "AdamW + clipnorm": lambda **kw: keras.optimizers.AdamW(
        0.01, weight_decay=0.05, clipnorm=0.1, **kw
    ),
    "Adam + LR schedule": lambda **kw: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.01, 4, 0.5), **kw
    ),
}


def model_with(optimizer):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


SEQUENCES, LENGTH, VOCAB, CLASSES = 48, 10, 20, 5


def sequence_data():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, LENGTH + 1, SEQUENCES)
    padding = np.arange(LENGTH)[None, :] >= lengths[:, None]
    tokens = rng.integers(1, VOCAB, (SEQUENCES, LENGTH))
    tokens[padding] = 0
    labels = rng.integers(0, CLASSES, (SEQUENCES, LENGTH))
    return tokens, labels, padding


SEQUENCE_CASES = {
    # case: (mask_zero, ignore_class, labels padded with -100, per-token weights)
    "Embedding(mask_zero=True)": (True, None, False, False),
    "SparseCategoricalCrossentropy(ignore_class=-100)": (False, -100, True, False),
    "padding as per-token sample_weight": (False, None, False, True),
}


def sequence_model(case, **optimizer_kw):
    mask_zero, ignore_class, _, _ = SEQUENCE_CASES[case]
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH,), dtype="int32")
    hidden = keras.layers.Embedding(VOCAB, 8, mask_zero=mask_zero)(inputs)
    # Self-attention passes the padding mask on to the loss; from Keras 3.16
    # an LSTM does not (keras-team/keras#23235).
    hidden = keras.layers.MultiHeadAttention(2, 4)(hidden, hidden)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.5, **optimizer_kw),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True, ignore_class=ignore_class))
    return model


def sequence_table(micro, steps, epochs):
    tokens, labels, padding = sequence_data()
    print(f"\n{SEQUENCES} sequences of 1..{LENGTH} tokens, self-attention tagger, SGD, batch "
          f"{micro * steps} vs {steps} x {micro}, {epochs} epochs, shuffle=False:\n")
    print("| loss | tfaccum (tokens) | tfaccum by samples | Keras gradient_accumulation_steps "
          "| no accumulation |")
    print("|---|---:|---:|---:|---:|")
    fit = dict(epochs=epochs, shuffle=False, verbose=0)
    for case, (_, _, ignored, weighted) in SEQUENCE_CASES.items():
        y = np.where(padding, -100, labels) if ignored else labels
        weights = (~padding).astype("float32") if weighted else None
        reference = sequence_model(case)
        reference.fit(tokens, y, batch_size=micro * steps, sample_weight=weights, **fit)
        row = []
        for reduction in ("auto", "samples"):
            ours = sequence_model(case)
            ours.fit(tokens, y, batch_size=micro, sample_weight=weights, **fit, callbacks=[
                GradientAccumulationCallback(accumulation_steps=steps, reduction=reduction)])
            row.append(distance(reference, ours))
        builtin = sequence_model(case, gradient_accumulation_steps=steps)
        builtin.fit(tokens, y, batch_size=micro, sample_weight=weights, **fit)
        plain = sequence_model(case)
        plain.fit(tokens, y, batch_size=micro, sample_weight=weights, **fit)
        row += [distance(reference, builtin), distance(reference, plain)]
        print(f"| {case} | " + " | ".join(f"{v:.1e}" for v in row) + " |")


def distance(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    fit = dict(epochs=args.epochs, shuffle=False, verbose=0)
    micro, steps = args.micro_batch, args.steps

    print(f"{args.samples} samples, batch {micro * steps} vs {steps} x {micro}, "
          f"{args.epochs} epochs: largest |weight - large-batch weight|\n")
    print("| optimizer | tfaccum | Keras gradient_accumulation_steps | no accumulation |")
    print("|---|---:|---:|---:|")
    for name, make in OPTIMIZERS.items():
        reference = model_with(make())
        reference.fit(x, y, batch_size=micro * steps, **fit)
        ours = model_with(make())
        ours.fit(x, y, batch_size=micro, callbacks=[
            GradientAccumulationCallback(accumulation_steps=steps)], **fit)
        builtin = model_with(make(gradient_accumulation_steps=steps))
        builtin.fit(x, y, batch_size=micro, **fit)
        plain = model_with(make())
        plain.fit(x, y, batch_size=micro, **fit)
        print(f"| {name} | {distance(reference, ours):.1e} | "
              f"{distance(reference, builtin):.1e} | {distance(reference, plain):.1e} |")
    sequence_table(micro=4, steps=4, epochs=2)


if __name__ == "__main__":
    main()
