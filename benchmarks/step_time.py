"""Time per micro-step: tfaccum vs Keras' own accumulation, apart from `fit`'s loop.

Each variant's compiled train function is called directly on a repeating
dataset, in blocks of whole windows; every round runs one block of each
variant in a new random order, so that machine noise hits them alike, and a
ratio between two variants is taken within each round. Reported: the median
ratio over rounds, a 95% bootstrap interval of that median, and the range of
the middle 90% of rounds. Blocks of a few windows (tens of milliseconds)
give hundreds of rounds in minutes: intervals about as wide as
`throughput.py`'s epochs give in three times as long (whose work, callbacks
and data pipeline included, is what users see), for each phase apart.

Two phases tell where a difference comes from:
  micro-steps  `accumulation_steps` larger than the run: no window ends
  windows      `accumulation_steps=--steps`: micro-steps and window ends,
               the optimizer's update included

    python benchmarks/step_time.py [--width 1024 --micro-batch 32 --steps 4]
        [--rounds 150] [--clock wall|cpu] [--threads 0|1]

Variants (Adam; tfaccum as the callback installs it, without `fit`):
  keras        optimizer(gradient_accumulation_steps=N)
  keras-again  the same again (the noise floor)
  tfaccum      the defaults (reduction="auto", the noise scale on)
  no-noise     noise_scale=False
  samples      reduction="samples", noise_scale=False (no item counting)
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfaccum  # noqa: E402
from throughput import median_interval  # noqa: E402
from throughput import verdict  # noqa: E402
from tfaccum.noise_scale import NoiseScaleEstimator  # noqa: E402

VARIANTS = ("keras", "keras-again", "tfaccum", "no-noise", "samples")
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
RATIOS = (
    ("keras-again", "keras", "noise floor: Keras accumulation vs itself"),
    ("tfaccum", "keras", "tfaccum vs Keras accumulation"),
    ("no-noise", "keras", "tfaccum without noise scale vs Keras accumulation"),
    ("tfaccum", "no-noise", "noise scale cost"),
    ("no-noise", "samples", "item counting cost (auto vs samples)"),
)
NEVER = 2**40  # accumulation_steps of the micro-steps phase


def build(variant, args, steps):
    """(the compiled train function, its iterator) for `variant`."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,))]
                             + [keras.layers.Dense(args.width, activation="relu")
                                for _ in range(2)]
                             + [keras.layers.Dense(10, activation="softmax")])
    accumulation = steps if variant.startswith("keras") else None
    model.compile(optimizer=keras.optimizers.Adam(1e-3, gradient_accumulation_steps=accumulation),
                  loss="sparse_categorical_crossentropy")
    if not variant.startswith("keras"):
        tfaccum.AccumulationHook.watched_by(
            model, (NoiseScaleEstimator(),) if variant == "tfaccum" else (),
            accumulation_steps=steps, reduction="samples" if variant == "samples" else "auto")
    model.make_train_function()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 64)).astype("float32")
    y = rng.integers(0, 10, 4096).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.micro_batch,
                                                             drop_remainder=True)
    return model.train_function, iter(data.repeat().prefetch(16))


def time_blocks(args, steps, block):
    """{variant: [seconds of a block of `block` micro-steps, per round]}."""
    functions = {variant: build(variant, args, steps) for variant in VARIANTS}
    clock = CLOCKS[args.clock]

    def run(variant):
        function, iterator = functions[variant]
        start = clock()
        for _ in range(block):
            function(iterator)
        return clock() - start

    for variant in VARIANTS:  # tracing, and the first windows
        for _ in range(3):
            run(variant)
    times = {variant: [] for variant in VARIANTS}
    rng = np.random.default_rng(1)
    for _ in range(args.rounds):
        for variant in rng.permutation(VARIANTS):
            times[variant].append(run(variant))
    return {variant: np.asarray(t) for variant, t in times.items()}


def ratio_rows(times):
    """(name, median, interval, 5-95% of rounds) for each of RATIOS."""
    rows = []
    for variant, baseline, name in RATIOS:
        per_round = times[variant] / times[baseline]
        rows.append((name, float(np.median(per_round)), median_interval(per_round),
                     tuple(float(p) for p in np.percentile(per_round, [5, 95]))))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--windows", type=int, default=2, help="windows per block")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--threads", type=int, default=0,
                        help="TensorFlow intra- and inter-op threads (0: its default)")
    args = parser.parse_args()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    block = args.steps * args.windows
    device = "GPU" if tf.config.list_physical_devices("GPU") else f"CPU ({os.cpu_count()} cores)"
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {device}; MLP "
          f"64-{args.width}x2-10, Adam, micro-batch {args.micro_batch}, accumulation_steps "
          f"{args.steps}; blocks of {block} micro-steps, {args.rounds} rounds; {args.clock} "
          f"time, {args.threads or 'default'} TensorFlow thread(s)")
    phases = {"micro-steps": time_blocks(args, NEVER, block),
              "windows": time_blocks(args, args.steps, block)}
    print()
    print("| variant | ms per micro-step: micro-steps | windows |")
    print("|---|---:|---:|")
    for variant in VARIANTS:
        cells = [f"{np.median(t[variant]) / block * 1e3:.3f}" for t in phases.values()]
        print(f"| {variant} | {' | '.join(cells)} |")
    print()
    print("Ratios of the two blocks of each round: median, 95% bootstrap interval of the "
          "median, 5-95% of rounds; \"within noise\": the interval holds 1.")
    print()
    print("| ratio | phase | median | 95% interval | 5-95% of rounds | verdict |")
    print("|---|---|---:|---:|---:|---|")
    rows = {phase: ratio_rows(times) for phase, times in phases.items()}
    for index in range(len(RATIOS)):
        for phase in phases:
            name, median, (lower, upper), (low, high) = rows[phase][index]
            print(f"| {name} | {phase} | {median:.3f} | {lower:.3f}-{upper:.3f} "
                  f"| {low:.3f}-{high:.3f} | {verdict(median, lower, upper)} |")


if __name__ == "__main__":
    main()
