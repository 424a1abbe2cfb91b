"""Keras 3 on PyTorch: peak memory and epoch time of accumulation, against plain training.

The model of `memory.py` and `jax_backend.py`: Dense 3072-3072-3072-10 (19M
weights, 72 MiB in float32), Adam, micro-batches of 16,
`accumulation_steps=4`, 512 samples. Each variant trains in a fresh process
with `KERAS_BACKEND=torch`, `--repeats` rounds in a new random order each;
reported per variant as the median and range over rounds:

- extra peak memory: the process's peak resident set size (`ru_maxrss`)
  minus plain micro-batch training's in the same round, in parameter bytes
  (the floor for accumulation: 1.0, one float32 copy);
- epoch time: the mean of epochs 2 to `--epochs`, divided by plain
  training's in the same round.

    python benchmarks/torch_backend.py [--repeats 3] [--epochs 3] [--width 3072]

Variants:
  plain       micro-batches of 16, no accumulation (the baseline)
  keras       Keras' Adam(gradient_accumulation_steps=4)
  tfaccum     GradientAccumulationCallback(accumulation_steps=4), defaults
  no-noise    the same with noise_scale=False (the noise scale's cost)
  torch-loop  hand-written PyTorch on the same weights, no Keras in the loop:
              `backward()` adding into `.grad` four times, then torch.optim.Adam
  large       one batch of 64 per update (what the window equals)

The last column is each variant's training loss in its last epoch, over
tfaccum's in the same round.
"""

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

from jax_backend import _version
from jax_backend import spread

VARIANTS = ("plain", "keras", "tfaccum", "no-noise", "torch-loop", "large")


def run_variant(variant, args):
    """Trains `variant` in this process; prints its peak RSS, epoch time and weights' bytes."""
    os.environ["KERAS_BACKEND"] = "torch"
    import keras
    import numpy as np

    import tfaccum

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, args.width)).astype("float32")
    y = rng.integers(0, 10, args.samples)
    inputs = keras.Input((args.width,))
    hidden = keras.layers.Dense(args.width, activation="relu")(inputs)
    hidden = keras.layers.Dense(args.width, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
    steps = args.steps if variant == "keras" else None
    model.compile(optimizer=keras.optimizers.Adam(1e-4, gradient_accumulation_steps=steps),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    if variant == "torch-loop":
        times, loss = torch_loop(model, x, y, args)
    else:
        times = []
        epoch = keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda e, logs: times.append(-time.perf_counter()),
            on_epoch_end=lambda e, logs: times.append(times.pop() + time.perf_counter()))
        callbacks = [epoch]
        if variant in ("tfaccum", "no-noise"):
            callbacks.insert(0, tfaccum.GradientAccumulationCallback(
                accumulation_steps=args.steps, noise_scale=False if variant == "no-noise" else None))
        batch = args.micro * args.steps if variant == "large" else args.micro
        history = model.fit(x, y, batch_size=batch, epochs=args.epochs, shuffle=False,
                            verbose=0, callbacks=callbacks)
        loss = history.history["loss"][-1]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"rss": rss, "epoch": statistics.mean(times[1:]), "loss": loss,
                      "weights": weights, "tensorflow": "tensorflow" in sys.modules}))


def torch_loop(model, x, y, args):
    """The model's weights trained by hand in PyTorch, as its users accumulate."""
    import torch

    params = [v.value for v in model.trainable_variables]
    optimizer = torch.optim.Adam(params, lr=1e-4, eps=1e-7)

    def forward(inputs):
        hidden = inputs
        for i in range(0, len(params) - 2, 2):
            hidden = torch.relu(hidden @ params[i] + params[i + 1])
        return hidden @ params[-2] + params[-1]

    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    times, losses, size = [], [], args.micro * args.steps
    for _ in range(args.epochs):
        start, losses = time.perf_counter(), []
        for begin in range(0, len(x) - size + 1, size):
            for k in range(begin, begin + size, args.micro):
                loss = torch.nn.functional.cross_entropy(
                    forward(xs[k:k + args.micro]), ys[k:k + args.micro])
                (loss / args.steps).backward()
                losses.append(float(loss))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times, statistics.mean(losses)


def measure(variant, args):
    command = [sys.executable, __file__, "--variant-only", variant, "--width", str(args.width),
               "--micro", str(args.micro), "--steps", str(args.steps),
               "--samples", str(args.samples), "--epochs", str(args.epochs)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--variant-only", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant_only:
        run_variant(args.variant_only, args)
        return
    rng = random.Random(0)
    memory, speed = {v: [] for v in VARIANTS[1:]}, {v: [] for v in VARIANTS[1:]}
    seconds, losses = {v: [] for v in VARIANTS}, {v: [] for v in VARIANTS}
    over_keras = []
    weights, tensorflow = None, set()
    for _ in range(args.repeats):
        order = list(VARIANTS)
        rng.shuffle(order)
        results = {variant: measure(variant, args) for variant in order}
        weights = results["plain"]["weights"]
        for variant, result in results.items():
            seconds[variant].append(result["epoch"])
            losses[variant].append(result["loss"] / results["tfaccum"]["loss"])
            if result["tensorflow"]:
                tensorflow.add(variant)
        for variant in VARIANTS[1:]:
            memory[variant].append((results[variant]["rss"] - results["plain"]["rss"]) / weights)
            speed[variant].append(results[variant]["epoch"] / results["plain"]["epoch"])
        over_keras.append(results["tfaccum"]["epoch"] / results["keras"]["epoch"])
    print(f"Keras {_version('keras')} on PyTorch {_version('torch')} (CPU): Dense "
          f"{args.width}x3 ({weights / 4 / 1e6:.1f}M weights), Adam, micro-batch {args.micro}, "
          f"accumulation_steps={args.steps}, {args.samples} samples; median (min-max) of "
          f"{args.repeats} rounds of fresh processes")
    print("| variant | extra peak RSS over plain (parameter bytes) | epoch time / plain's "
          "| epoch (s) | last loss / tfaccum's |")
    print("|---|---:|---:|---:|---:|")
    print(f"| plain | - | 1 | {spread(seconds['plain'])} | {spread(losses['plain'])} |")
    for variant in VARIANTS[1:]:
        print(f"| {variant} | {spread(memory[variant])} | {spread(speed[variant])} "
              f"| {spread(seconds[variant])} | {spread(losses[variant])} |")
    print(f"tfaccum's epoch / Keras' own, round by round: {spread(over_keras)}")
    if tensorflow:  # Keras imports it where it is installed, plain training too
        print(f"TensorFlow was imported by: {sorted(tensorflow)}")


if __name__ == "__main__":
    main()
