"""Window-wide losses: peak memory against the large batch, time against ordinary accumulation.

A two-tower model whose activations dominate its weights (each tower: 32
tokens of 128 features, three per-token Dense(256) layers, mean-pooled to a
128-d embedding; 0.4M weights), compiled with `tfaccum.InBatchSoftmax`.
Micro-batches of 32; for each window length N:

  large     the batch of N x 32, plainly (what the window equals)
  window    tfaccum, N micro-batches of 32, the loss over the window (gradient caching)
  ordinary  tfaccum, the same loss per micro-batch (ordinary accumulation: not the
            large batch, but the same samples at the same micro-batch)

Each variant trains 2 windows (2 x N x 32 samples) alone in a fresh process,
`--repeats` times in a new random order each round. Peak memory is
TensorFlow's peak allocation (its BFC allocator, as in memory.py) over plain
training at batch 32 on the same samples (so the data's own tensors cancel),
in MiB; on JAX (`--backend jax`, which reports no allocator peak on the CPU)
the process's peak resident set size over plain's, as in jax_backend.py.
Time is the fit's wall clock, after a first fit that traces (compiled with
XLA on JAX, as Keras' default there). Reported: the median (min-max) over
rounds.

    python benchmarks/window_loss.py [--repeats 2] [--windows 2,8,32] [--backend jax]
"""

import argparse
import json
import os
import resource
import random
import statistics
import subprocess
import sys
import time

MICRO = 32
TOKENS, FEATURES, WIDTH, EMBEDDING = 32, 128, 256, 128


def run_variant(variant, steps, args):
    """Trains one variant in this process; prints its peak memory and time."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ["KERAS_BACKEND"] = args.backend
    import keras
    import numpy as np

    import tfaccum

    keras.utils.set_random_seed(0)
    samples = 2 * steps * MICRO  # plain trains the same samples at batch MICRO
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(samples, TOKENS, FEATURES)).astype("float32") for _ in range(2)]
    y = np.zeros(samples, "float32")

    def tower():
        layers = [keras.layers.Dense(WIDTH, activation="relu") for _ in range(3)]
        return keras.Sequential(layers + [keras.layers.GlobalAveragePooling1D(),
                                          keras.layers.Dense(EMBEDDING)])

    inputs = [keras.Input((TOKENS, FEATURES)) for _ in range(2)]
    outputs = keras.layers.Concatenate()([tower()(inputs[0]), tower()(inputs[1])])
    model = keras.Model(inputs, outputs)
    window_loss = tfaccum.InBatchSoftmax(temperature=0.05)

    def per_micro_batch(y_true, y_pred):
        return window_loss.call(y_true, y_pred)

    loss = per_micro_batch if variant in ("ordinary", "plain") else window_loss
    model.compile(keras.optimizers.Adam(1e-4), loss=loss,
                  jit_compile=args.backend == "jax")
    callbacks, batch = [], MICRO
    if variant == "large":
        batch = steps * MICRO
    elif variant in ("window", "ordinary"):
        callbacks.append(tfaccum.GradientAccumulationCallback(accumulation_steps=steps))
    fit = dict(batch_size=batch, shuffle=False, verbose=0, callbacks=callbacks)
    model.fit(x, y, epochs=1, **fit)  # traces
    if args.backend == "jax":
        start = time.perf_counter()
        model.fit(x, y, epochs=1, **fit)
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({"peak": peak, "seconds": seconds}))
        return
    import tensorflow as tf

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    tf.config.experimental.reset_memory_stats(device)
    start = time.perf_counter()
    model.fit(x, y, epochs=1, **fit)
    seconds = time.perf_counter() - start
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    print(json.dumps({"peak": peak, "seconds": seconds}))


def measure(variant, steps, backend):
    command = [sys.executable, __file__, "--variant-only", variant, "--steps", str(steps),
               "--backend", backend]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _summary(values, digits):
    values = sorted(values)
    return (f"{statistics.median(values):.{digits}f} "
            f"({values[0]:.{digits}f}-{values[-1]:.{digits}f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--windows", default="2,8,32")
    parser.add_argument("--backend", choices=("tensorflow", "jax"), default="tensorflow")
    parser.add_argument("--variant-only", choices=("plain", "large", "window", "ordinary"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant_only:
        run_variant(args.variant_only, args.steps, args)
        return
    windows = [int(n) for n in args.windows.split(",")]
    runs = [(variant, n) for n in windows for variant in ("large", "window", "ordinary")]
    plains = [("plain", n) for n in windows]  # the same data: 2 x N micro-batches
    memory = {run: [] for run in runs}
    ratio = {n: [] for n in windows}
    rng = random.Random(0)
    for _ in range(args.repeats):
        order = plains + runs
        rng.shuffle(order)
        results = {run: measure(*run, args.backend) for run in order}
        for variant, n in runs:
            plain = results[("plain", n)]["peak"]
            memory[(variant, n)].append((results[(variant, n)]["peak"] - plain) / 2**20)
        for n in windows:
            ratio[n].append(results[("window", n)]["seconds"]
                            / results[("ordinary", n)]["seconds"])
    unit = "peak resident memory" if args.backend == "jax" else "peak memory"
    print(f"Keras 3 on {args.backend}. Two towers ({TOKENS} tokens x {FEATURES} -> 3 x Dense({WIDTH}) per token -> "
          f"{EMBEDDING}-d), InBatchSoftmax, micro-batches of {MICRO}; {unit} over plain "
          f"training at batch {MICRO} on the same samples (MiB) and window-wide time over ordinary accumulation "
          f"of the same samples: median (min-max) of {args.repeats} rounds of fresh processes")
    print("| N (batch) | large batch | window-wide (tfaccum) | ordinary accumulation | "
          "time: window-wide / ordinary |")
    print("|---|---:|---:|---:|---:|")
    for n in windows:
        print(f"| {n} ({n * MICRO}) | {_summary(memory[('large', n)], 1)} | "
              f"{_summary(memory[('window', n)], 1)} | {_summary(memory[('ordinary', n)], 1)} | "
              f"{_summary(ratio[n], 2)} |", flush=True)


if __name__ == "__main__":
    main()
