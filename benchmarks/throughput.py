"""Epoch time and peak memory: tfaccum vs Keras' own accumulation vs plain training.

All variants train the same model on the same data in one run, alternating
round by round so that machine noise hits them alike. A ratio between two
variants is taken within each round (the two epochs ran seconds apart) and
reported as the median over rounds with its spread (min-max and the 10th-90th
percentile of the per-round ratios). Two copies of Keras' accumulation
("keras" and "keras-again") measure the noise itself: their ratio should be
1, and its spread is what a difference must exceed to mean something. Figures
whose 10-90% range contains 1 are marked "within noise".

    python benchmarks/throughput.py [--model mlp|cnn] [--rounds 15]

Variants:
  tfaccum      batch B, GradientAccumulationCallback(accumulation_steps=N)
               (defaults: the noise scale is estimated)
  tfaccum-no-noise  the same with noise_scale=False
  tfaccum+log_dir  the defaults, writing Accumulation summaries to a temporary dir
  keras        batch B, optimizer(gradient_accumulation_steps=N)
  keras-again  the same again (the noise floor)
  micro        batch B, no accumulation (N times more optimizer updates)
  large        batch N*B, no accumulation (what accumulation emulates)

Peak memory: on a GPU, TensorFlow's peak allocation per variant; on the CPU,
the peak resident set size of a fresh process that trains that variant alone
(for a small model, mostly TensorFlow itself).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfaccum import GradientAccumulationCallback  # noqa: E402

VARIANTS = ("tfaccum", "tfaccum-no-noise", "tfaccum+log_dir", "keras", "keras-again",
            "micro", "large")
# (variant, baseline) ratios the report states, with their spread.
RATIOS = (
    ("keras-again", "keras", "noise floor: Keras accumulation vs itself"),
    ("tfaccum", "keras", "tfaccum vs Keras accumulation"),
    ("tfaccum-no-noise", "keras", "tfaccum without noise scale vs Keras accumulation"),
    ("tfaccum", "tfaccum-no-noise", "noise scale cost"),
    ("tfaccum+log_dir", "tfaccum", "log_dir cost"),
    ("tfaccum", "micro", "tfaccum vs plain micro-batch"),
    ("large", "micro", "large batch vs plain micro-batch"),
)


def load_data(samples):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    repeat = -(-samples // len(x))
    return np.tile(x, (repeat, 1))[:samples], np.tile(y, repeat)[:samples]


def build(variant, args):
    keras.utils.set_random_seed(0)
    if args.model == "cnn":
        layers = [
            keras.Input((64,)),
            keras.layers.Reshape((8, 8, 1)),
            keras.layers.UpSampling2D(4),  # 32 x 32, like a small image data set
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
        ]
    else:
        layers = [keras.Input((64,))]
        layers += [keras.layers.Dense(args.width, activation="relu") for _ in range(args.depth)]
    layers += [keras.layers.Dense(10, activation="softmax")]
    model = keras.Sequential(layers)
    keras_accumulates = variant.startswith("keras")
    extra = {"gradient_accumulation_steps": args.steps} if keras_accumulates else {}
    model.compile(optimizer=keras.optimizers.Adam(1e-3, **extra),
                  loss="sparse_categorical_crossentropy")
    batch_size = args.micro_batch * (args.steps if variant == "large" else 1)
    callbacks = []
    if variant.startswith("tfaccum"):
        log_dir = tempfile.mkdtemp(prefix="tfaccum-bench-") if "log_dir" in variant else None
        callbacks.append(GradientAccumulationCallback(
            accumulation_steps=args.steps, log_dir=log_dir,
            noise_scale=False if variant == "tfaccum-no-noise" else None))
    return model, batch_size, callbacks


class EpochTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def time_variants(args, x, y):
    """Per-round epoch times: {variant: [seconds per round]}."""
    models = {variant: build(variant, args) for variant in VARIANTS}
    times = {variant: [] for variant in VARIANTS}
    order = list(VARIANTS)
    for round_ in range(args.rounds + 1):  # round 0 warms up (tracing)
        # Alternate the order too, so that no variant always follows another.
        for variant in order if round_ % 2 else reversed(order):
            model, batch_size, callbacks = models[variant]
            timer = EpochTimer()
            model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0,
                      callbacks=callbacks + [timer])
            if round_:
                times[variant].append(timer.seconds[0])
    return times


def spread(values):
    """(median, min, max, 10th percentile, 90th percentile) of `values`."""
    values = np.asarray(values)
    return (float(np.median(values)), float(values.min()), float(values.max()),
            float(np.percentile(values, 10)), float(np.percentile(values, 90)))


def ratio_rows(times):
    """For each of RATIOS: its name and the spread of its per-round ratios."""
    rows = []
    for variant, baseline, name in RATIOS:
        per_round = np.asarray(times[variant]) / np.asarray(times[baseline])
        rows.append((name, variant, baseline, spread(per_round)))
    return rows


def peak_memory_mb(variant, args):
    """Trains one variant alone in a fresh process; returns its peak memory in MB."""
    command = [sys.executable, __file__, "--memory-of", variant] + sys.argv[1:]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mb"]


def measure_memory_of(variant, args, x, y):
    model, batch_size, callbacks = build(variant, args)
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.experimental.reset_memory_stats("GPU:0")
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, callbacks=callbacks)
    if gpus:
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_mb": peak}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp",
                        help="mlp: 0.3M weights, tiny steps (the worst case for "
                        "per-step overhead); cnn: small conv net on 32x32 images")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-of", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    x, y = load_data(args.samples)
    if args.memory_of:
        measure_memory_of(args.memory_of, args, x, y)
        return

    device = "GPU" if tf.config.list_physical_devices("GPU") else f"CPU ({os.cpu_count()} cores)"
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {device}; "
          f"{args.samples} samples, "
          f"{'CNN 32x32' if args.model == 'cnn' else f'MLP 64-{args.width}x{args.depth}-10'}, "
          f"micro-batch {args.micro_batch}, accumulation_steps {args.steps}, "
          f"{args.rounds} alternating rounds")
    times = time_variants(args, x, y)
    memory = {} if args.no_memory else {v: peak_memory_mb(v, args) for v in VARIANTS}
    print()
    print("| variant | epoch s: median (min-max) | peak memory MB |")
    print("|---|---:|---:|")
    for variant in VARIANTS:
        median, low, high = spread(times[variant])[:3]
        mem = f"{memory[variant]:.0f}" if memory else "-"
        print(f"| {variant} | {median:.3f} ({low:.3f}-{high:.3f}) | {mem} |")
    rows = ratio_rows(times)
    floor = rows[0][3]
    print()
    print(f"Per-round ratios over {args.rounds} rounds; noise floor (Keras accumulation "
          f"against itself): 10-90% {floor[3]:.3f}-{floor[4]:.3f}.")
    print()
    print("| ratio | median | 10-90% | min-max | verdict |")
    print("|---|---:|---:|---:|---|")
    for name, _, _, (median, low, high, p10, p90) in rows:
        verdict = "within noise" if p10 <= 1.0 <= p90 else (
            "slower" if median > 1 else "faster")
        print(f"| {name} | {median:.3f} | {p10:.3f}-{p90:.3f} | {low:.3f}-{high:.3f} | {verdict} |")


if __name__ == "__main__":
    main()
