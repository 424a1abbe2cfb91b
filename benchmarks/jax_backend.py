"""Keras 3 on JAX: peak memory and epoch time of accumulation, against plain training.

The model of `memory.py`: Dense 3072-3072-3072-10 (19M weights, 72 MiB in
float32), Adam, micro-batches of 16, `accumulation_steps=4`, 512 samples.
Each variant trains in a fresh process with `KERAS_BACKEND=jax`, `--repeats`
rounds in a new random order each; reported per variant, as the median and
range over rounds:

- extra peak memory: the process's peak resident set size (`ru_maxrss`, what
  `top` shows) minus plain micro-batch training's in the same round, in
  parameter bytes (the floor for accumulation: 1.0, one float32 copy);
- epoch time: the mean of epochs 2 to `--epochs` (the first compiles),
  divided by plain training's in the same round.

    python benchmarks/jax_backend.py [--repeats 3] [--epochs 3] [--width 3072]
    python benchmarks/jax_backend.py --devices 2   # keras.distribution.DataParallel

With `--devices N` every variant (plain training too) runs under
`keras.distribution.DataParallel` on N host devices
(`--xla_force_host_platform_device_count`): each device holds the
variables, the optimizer's slots and the accumulators, so the memory
column is the process's (N devices') over plain's, in one device's
parameter bytes. On a CPU the devices share its cores.

Variants:
  plain      micro-batches of 16, no accumulation (the baseline)
  keras      Keras' Adam(gradient_accumulation_steps=4)
  tfaccum    GradientAccumulationCallback(accumulation_steps=4), defaults
  no-noise   the same with noise_scale=False (the noise scale's cost)
  bfloat16   tfaccum with accumulator_dtype="bfloat16"
  window     tfaccum with steps_per_execution=4: each window one compiled program
  window-no-noise  the same with noise_scale=False
  jax-loop   hand-written JAX, no Keras in the loop: a jitted host loop adding each
             micro-batch's gradient into donated accumulators, Adam every 4th
  jax-scan   hand-written JAX: a window compiled as one program (`lax.scan` over
             its 4 micro-batches, then Adam), as Levanter and MaxText accumulate

The last column is each variant's training loss in its last epoch, over
tfaccum's (float32 accumulators) in the same round.
"""

import argparse
import functools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("plain", "keras", "tfaccum", "no-noise", "bfloat16", "window", "window-no-noise",
            "jax-loop", "jax-scan")
HAND_WRITTEN = ("jax-loop", "jax-scan")


def run_variant(variant, args):
    """Trains `variant` in this process; prints its peak RSS, epoch times and weights' bytes."""
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import numpy as np

    import tfaccum

    keras.utils.set_random_seed(0)
    if args.devices > 1:
        keras.distribution.set_distribution(keras.distribution.DataParallel())
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
    if variant in HAND_WRITTEN:
        times, loss = hand_written(variant, model, x, y, args)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({"rss": rss, "epoch": statistics.mean(times[1:]), "loss": loss,
                          "weights": weights, "tensorflow": "tensorflow" in sys.modules}))
        return

    class EpochTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self._start)

    times = EpochTimes()
    callbacks = [times]
    if variant in ("tfaccum", "no-noise", "bfloat16", "window", "window-no-noise"):
        callbacks.insert(0, tfaccum.GradientAccumulationCallback(
            accumulation_steps=args.steps, noise_scale=False if "no-noise" in variant else None,
            accumulator_dtype="bfloat16" if variant == "bfloat16" else "float32"))
    if variant.startswith("window"):
        model.compile(optimizer=keras.optimizers.Adam(1e-4), steps_per_execution=args.steps,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=args.micro, epochs=args.epochs, shuffle=False,
                        verbose=0, callbacks=callbacks)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"rss": rss, "epoch": statistics.mean(times.times[1:]),
                      "loss": history.history["loss"][-1],
                      "weights": weights, "tensorflow": "tensorflow" in sys.modules}))


def hand_written(variant, model, x, y, args):
    """The model's first weights trained by hand in JAX; epoch times and the last loss."""
    import jax
    import jax.numpy as jnp

    params = [jnp.asarray(v.value) for v in model.trainable_variables]

    def loss_of(params, x, y):
        hidden = x
        for i in range(0, len(params) - 2, 2):
            hidden = jax.nn.relu(hidden @ params[i] + params[i + 1])
        logits = hidden @ params[-2] + params[-1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    gradient = jax.value_and_grad(loss_of)
    b1, b2, epsilon, rate = 0.9, 0.999, 1e-7, 1e-4

    def adam(params, slots, grads):
        m, v, t = slots
        t = t + 1
        m = [b1 * a + (1 - b1) * g for a, g in zip(m, grads)]
        v = [b2 * a + (1 - b2) * g * g for a, g in zip(v, grads)]
        step = rate * jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        params = [p - step * a / (jnp.sqrt(b) + epsilon) for p, a, b in zip(params, m, v)]
        return params, (m, v, t)

    slots = ([jnp.zeros_like(p) for p in params], [jnp.zeros_like(p) for p in params],
             jnp.float32(0))
    steps, micro = args.steps, args.micro
    if variant == "jax-scan":
        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def window(params, slots, xs, ys):
            def add(carry, batch):
                total, sums = carry
                loss, grads = gradient(params, *batch)
                return (total + loss, [s + g for s, g in zip(sums, grads)]), None

            start = (jnp.float32(0), [jnp.zeros_like(p) for p in params])
            (total, sums), _ = jax.lax.scan(add, start, (xs, ys))
            params, slots = adam(params, slots, [s / steps for s in sums])
            return params, slots, total / steps
    else:
        @functools.partial(jax.jit, donate_argnums=(0,))
        def accumulate(sums, params, x, y):
            loss, grads = gradient(params, x, y)
            return [s + g for s, g in zip(sums, grads)], loss

        @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
        def update(params, slots, sums):
            params, slots = adam(params, slots, [s / steps for s in sums])
            return params, slots, [jnp.zeros_like(s) for s in sums]

        sums = [jnp.zeros_like(p) for p in params]
    times, size = [], micro * steps
    for _ in range(args.epochs):
        start = time.perf_counter()
        losses = []
        for begin in range(0, len(x) - size + 1, size):
            xs = x[begin:begin + size].reshape(steps, micro, -1)
            ys = y[begin:begin + size].reshape(steps, micro)
            if variant == "jax-scan":
                params, slots, loss = window(params, slots, xs, ys)
                losses.append(loss)
            else:
                for k in range(steps):
                    sums, loss = accumulate(sums, params, xs[k], ys[k])
                    losses.append(loss)
                params, slots, sums = update(params, slots, sums)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - start)
    return times, float(jnp.mean(jnp.stack(losses)))


def measure(variant, args):
    command = [sys.executable, __file__, "--variant-only", variant, "--width", str(args.width),
               "--micro", str(args.micro), "--steps", str(args.steps),
               "--samples", str(args.samples), "--epochs", str(args.epochs),
               "--devices", str(args.devices)]
    env = dict(os.environ)
    if args.devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def spread(values):
    values = sorted(values)
    return f"{statistics.median(values):.2f} ({values[0]:.2f}-{values[-1]:.2f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--devices", type=int, default=1,
                        help="N > 1: keras.distribution.DataParallel on N host devices")
    parser.add_argument("--variant-only", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant_only:
        run_variant(args.variant_only, args)
        return
    rng = random.Random(0)
    memory = {v: [] for v in VARIANTS[1:]}
    speed = {v: [] for v in VARIANTS[1:]}
    seconds = {v: [] for v in VARIANTS}
    losses = {v: [] for v in VARIANTS}
    scan = {v: [] for v in VARIANTS}
    weights, tensorflow = None, set()
    for _ in range(args.repeats):
        order = list(VARIANTS)
        rng.shuffle(order)
        results = {variant: measure(variant, args) for variant in order}
        weights = results["plain"]["weights"]
        for variant, result in results.items():
            seconds[variant].append(result["epoch"])
            losses[variant].append(result["loss"] / results["tfaccum"]["loss"])
            scan[variant].append(result["epoch"] / results["jax-scan"]["epoch"])
            if result["tensorflow"]:
                tensorflow.add(variant)
        for variant in VARIANTS[1:]:
            memory[variant].append((results[variant]["rss"] - results["plain"]["rss"]) / weights)
            speed[variant].append(results[variant]["epoch"] / results["plain"]["epoch"])
    print(f"Keras {_version('keras')} on JAX {_version('jax')} (CPU): Dense {args.width}x3 "
          f"({weights / 4 / 1e6:.1f}M weights), Adam, micro-batch {args.micro}, "
          f"accumulation_steps={args.steps}, {args.samples} samples"
          f"{f', DataParallel on {args.devices} devices' if args.devices > 1 else ''}; "
          f"median (min-max) of "
          f"{args.repeats} rounds of fresh processes")
    print("| variant | extra peak RSS over plain (parameter bytes) | epoch time / plain's "
          "| epoch (s) | epoch / jax-scan's | last loss / tfaccum's |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| plain | - | 1 | {spread(seconds['plain'])} | {spread(scan['plain'])} "
          f"| {spread(losses['plain'])} |")
    for variant in VARIANTS[1:]:
        print(f"| {variant} | {spread(memory[variant])} | {spread(speed[variant])} "
              f"| {spread(seconds[variant])} | {spread(scan[variant])} "
              f"| {spread(losses[variant])} |")
    if tensorflow:
        print(f"TensorFlow was imported by: {sorted(tensorflow)}")


def _version(name):
    """The module's own version (Keras' pre-release is the `keras-nightly` distribution)."""
    import importlib

    return importlib.import_module(name).__version__


if __name__ == "__main__":
    main()
