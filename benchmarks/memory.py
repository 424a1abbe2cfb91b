"""Peak memory of accumulation, in parameter bytes over plain micro-batch training.

The model is large enough that the accumulators dominate TensorFlow's own
footprint: Dense 3072-3072-3072-10 (19M weights, 72 MiB in float32), Adam,
micro-batches of 16, `accumulation_steps=4`, one epoch of 512 samples. Each
variant trains alone in a fresh process, `--repeats` times, in a new random
order each round; its peak (TensorFlow's peak allocation, read from its BFC
allocator on the CPU as on a GPU: the bytes of every tensor and variable
alive at once, not the process's resident set, which the C allocator's
caching moves by about 0.4 parameter bytes from run to run) minus plain
micro-batch training's in the same round, divided by the weights' bytes, is
reported as the median and range over rounds, beside the floor: the
accumulators tfaccum must hold (one float32 copy of the trainable weights:
1.0).

    python benchmarks/memory.py [--repeats 3] [--width 3072] [--variants a,b]
    python benchmarks/memory.py --allocator default   # peak resident set instead

`--allocator default` leaves TensorFlow's CPU allocator as a CPU user runs it
(no BFC) and reports each process's peak resident set size (`ru_maxrss`)
instead: what `top` shows, with the C allocator's caching in it.

Variants:
  plain          micro-batches of 16, no accumulation (the baseline)
  large          one batch of 64 (what accumulation emulates)
  keras          Keras' optimizer(gradient_accumulation_steps=4)
  tfaccum        GradientAccumulationCallback(accumulation_steps=4), defaults
  no-noise       the same with noise_scale=False
  samples        the same with reduction="samples"
  log_dir        the defaults, writing summaries
  two-outputs    a second output whose loss counts differently (its own channel)
  bfloat16       the defaults with accumulator_dtype="bfloat16" (floor 0.5)
"""

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile

VARIANTS = ("plain", "large", "keras", "tfaccum", "no-noise", "samples", "log_dir",
            "two-outputs", "bfloat16")
FLOORS = {"tfaccum": 1.0, "no-noise": 1.0, "samples": 1.0, "log_dir": 1.0,
          "two-outputs": 2.0, "bfloat16": 0.5, "keras": 1.0}


def run_variant(variant, args):
    """Trains `variant` in this process; prints its peak memory (bytes) and weights' bytes."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # TensorFlow's BFC allocator on the CPU too: it counts every tensor's
    # bytes and its peak (`get_memory_info`), as on a GPU. The resident set
    # size, also printed, moves with the C allocator's caching by +-0.4
    # parameter bytes from one process to the next.
    if args.allocator == "bfc":
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    import keras
    import numpy as np
    import tensorflow as tf

    import tfaccum

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, args.width)).astype("float32")
    y = rng.integers(0, 10, args.samples)
    inputs = keras.Input((args.width,))
    hidden = keras.layers.Dense(args.width, activation="relu")(inputs)
    hidden = keras.layers.Dense(args.width, activation="relu")(hidden)
    outputs = keras.layers.Dense(10)(hidden)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if variant == "two-outputs":
        sequence = keras.layers.Reshape((args.width // 64, 64))(hidden)
        per_token = keras.layers.Dense(10)(keras.layers.Masking(0.0)(sequence))
        model = keras.Model(inputs, {"class": outputs, "tokens": per_token})
        y = {"class": y, "tokens": rng.integers(0, 10, (args.samples, args.width // 64))}
        loss = {"class": loss, "tokens": keras.losses.SparseCategoricalCrossentropy(
            from_logits=True)}
    else:
        model = keras.Model(inputs, outputs)
    steps = args.steps if variant == "keras" else None
    model.compile(optimizer=keras.optimizers.Adam(1e-4, gradient_accumulation_steps=steps),
                  loss=loss)
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    callbacks, batch = [], args.micro
    options = {"no-noise": dict(noise_scale=False), "samples": dict(reduction="samples"),
               "bfloat16": dict(accumulator_dtype="bfloat16")}
    if variant == "large":
        batch = args.micro * args.steps
    elif variant not in ("plain", "keras"):
        kwargs = dict(options.get(variant, {}))
        if variant == "log_dir":
            kwargs["log_dir"] = tempfile.mkdtemp()
        callbacks.append(tfaccum.GradientAccumulationCallback(
            accumulation_steps=args.steps, **kwargs))
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    tf.config.experimental.reset_memory_stats(device)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = rss
    if args.allocator == "bfc" or device != "CPU:0":
        peak = tf.config.experimental.get_memory_info(device)["peak"]
    print(json.dumps({"peak": peak, "rss": rss, "weights": weights}))


def measure(variant, args):
    command = [sys.executable, __file__, "--variant-only", variant, "--width", str(args.width),
               "--micro", str(args.micro), "--steps", str(args.steps),
               "--samples", str(args.samples), "--allocator", args.allocator]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--allocator", choices=("bfc", "default"), default="bfc",
                        help="bfc: TensorFlow's peak allocation; default: the CPU's "
                             "default allocator, peak resident set size")
    parser.add_argument("--variant-only", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant_only:
        run_variant(args.variant_only, args)
        return
    variants = [v for v in args.variants.split(",") if v != "plain"]
    rng = random.Random(0)
    extra = {v: [] for v in variants}
    weights = None
    for _ in range(args.repeats):
        order = ["plain"] + variants
        rng.shuffle(order)
        peaks = {}
        for variant in order:
            result = measure(variant, args)
            peaks[variant] = result["peak"]
            weights = result["weights"] if variant == "plain" else weights
        for variant in variants:
            extra[variant].append((peaks[variant] - peaks["plain"]) / weights)
    what = ("peak resident set size (default CPU allocator)" if args.allocator == "default"
            else "peak memory")
    print(f"Dense {args.width}x3 ({weights / 4 / 1e6:.1f}M weights, {weights / 2**20:.0f} MiB), "
          f"micro-batch {args.micro}, accumulation_steps={args.steps}; {what} over plain "
          f"micro-batch training, in parameter bytes: median (min-max) of {args.repeats} rounds "
          "of fresh processes")
    print("| variant | extra peak memory | floor |")
    print("|---|---:|---:|")
    for variant in variants:
        values = sorted(extra[variant])
        floor = FLOORS.get(variant)
        print(f"| {variant} | {statistics.median(values):.2f} ({values[0]:.2f}-{values[-1]:.2f}) "
              f"| {'-' if floor is None else f'{floor:.1f}'} |", flush=True)


if __name__ == "__main__":
    main()
