"""Epoch time and peak memory: tfaccum vs Keras' own accumulation vs plain training.

All variants train the same model on the same data in one run, alternating
round by round so that machine noise hits them alike. A ratio between two
variants is taken within each round (the two epochs ran close together, in
a new random order every round) and reported as the median over rounds, with
a 95% bootstrap interval of that median and the range of the rounds. Two
copies of Keras' accumulation ("keras" and "keras-again") measure the noise
itself: their ratio should be 1. A ratio whose interval holds 1 is marked
"within noise". Times are the process's CPU time with one TensorFlow thread
by default: the work per step, which a virtual machine's steal time does
not inflate (`--clock wall --threads 0` for elapsed time as users see it).

    python benchmarks/throughput.py [--model mlp|cnn] [--rounds 15]

Variants:
  tfaccum      batch B, GradientAccumulationCallback(accumulation_steps=N)
               (defaults: the noise scale is estimated)
  tfaccum-no-noise  the same with noise_scale=False
  tfaccum-samples  the same with reduction="samples" (no item counting)
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

MODELS = {"cnn": "CNN 32x32", "seq": "masked GRU tagger, 4..32 tokens",
          "heads": "masked GRU with a per-token and a per-sequence head"}
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
VARIANTS = ("tfaccum", "tfaccum-no-noise", "tfaccum-samples", "tfaccum+log_dir", "keras",
            "keras-again", "micro", "large")
# (variant, baseline) ratios the report states, with their spread.
RATIOS = (
    ("keras-again", "keras", "noise floor: Keras accumulation vs itself"),
    ("tfaccum", "keras", "tfaccum vs Keras accumulation"),
    ("tfaccum-no-noise", "keras", "tfaccum without noise scale vs Keras accumulation"),
    ("tfaccum", "tfaccum-no-noise", "noise scale cost"),
    ("tfaccum-no-noise", "tfaccum-samples", "item counting cost (auto vs samples)"),
    ("tfaccum+log_dir", "tfaccum", "log_dir cost"),
    ("tfaccum", "micro", "tfaccum vs plain micro-batch"),
    ("large", "micro", "large batch vs plain micro-batch"),
)


def load_data(samples, model="mlp"):
    if model in ("seq", "heads"):
        # Padded sequences of 4..32 tokens, a per-token label each.
        rng = np.random.default_rng(0)
        lengths = rng.integers(4, 33, samples)
        tokens = rng.integers(1, 1000, (samples, 32))
        tokens[np.arange(32)[None, :] >= lengths[:, None]] = 0
        labels = rng.integers(0, 10, (samples, 32))
        if model == "heads":  # and a label per sequence
            return tokens, {"per_token": labels, "per_sequence": labels[:, :1]}
        return tokens, labels
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    repeat = -(-samples // len(x))
    return np.tile(x, (repeat, 1))[:samples], np.tile(y, repeat)[:samples]


def build(variant, args):
    keras.utils.set_random_seed(0)
    if args.model == "heads":
        inputs = keras.Input((32,), dtype="int32")
        hidden = keras.layers.GRU(64, return_sequences=True)(
            keras.layers.Embedding(1000, 64, mask_zero=True)(inputs))
        model = keras.Model(inputs, {
            "per_token": keras.layers.Dense(10, activation="softmax", name="per_token")(hidden),
            "per_sequence": keras.layers.Dense(10, activation="softmax", name="per_sequence")(
                keras.layers.GlobalAveragePooling1D()(hidden))})
        layers = None
    elif args.model == "seq":
        layers = [
            keras.Input((32,), dtype="int32"),
            keras.layers.Embedding(1000, 64, mask_zero=True),
            keras.layers.GRU(64, return_sequences=True),
        ]
    elif args.model == "cnn":
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
    if layers is not None:
        layers += [keras.layers.Dense(10, activation="softmax")]
        model = keras.Sequential(layers)
    keras_accumulates = variant.startswith("keras")
    extra = {"gradient_accumulation_steps": args.steps} if keras_accumulates else {}
    model.compile(optimizer=keras.optimizers.Adam(1e-3, **extra),
                  loss="sparse_categorical_crossentropy")  # masked for "seq", per-token head
    batch_size = args.micro_batch * (args.steps if variant == "large" else 1)
    callbacks = []
    if variant.startswith("tfaccum"):
        log_dir = tempfile.mkdtemp(prefix="tfaccum-bench-") if "log_dir" in variant else None
        callbacks.append(GradientAccumulationCallback(
            accumulation_steps=args.steps, log_dir=log_dir,
            reduction="samples" if variant == "tfaccum-samples" else "auto",
            noise_scale=False if variant in ("tfaccum-no-noise", "tfaccum-samples") else None))
    return model, batch_size, callbacks


class EpochTimer(keras.callbacks.Callback):
    """Seconds per epoch, by `clock` (wall time, or the process's CPU time)."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self.clock()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(self.clock() - self._start)


def time_variants(args, x, y):
    """Per-round epoch times: {variant: [seconds per round]}."""
    models = {variant: build(variant, args) for variant in VARIANTS}
    times = {variant: [] for variant in VARIANTS}
    rng = np.random.default_rng(1)
    for round_ in range(args.rounds + 1):  # round 0 warms up (tracing)
        # A new order every round, so that no variant always follows another.
        for variant in rng.permutation(VARIANTS):
            model, batch_size, callbacks = models[variant]
            timer = EpochTimer(CLOCKS[args.clock])
            model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0,
                      callbacks=callbacks + [timer])
            if round_:
                times[variant].append(timer.seconds[0])
    return times


def spread(values):
    """(median, min, max) of `values`."""
    values = np.asarray(values)
    return float(np.median(values)), float(values.min()), float(values.max())


def median_interval(values, confidence=0.95, resamples=4000):
    """A bootstrap confidence interval of the median of `values` (rounds resampled)."""
    values = np.asarray(values)
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(values, (resamples, len(values))), axis=1)
    tail = (1 - confidence) / 2 * 100
    return float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))


def verdict(median, lower, upper, digits=3):
    """"within noise" where the median's interval holds 1, else "slower" or "faster".

    The interval is read at the `digits` the tables print it with, so that the verdict
    agrees with the figures beside it (an upper end of 0.99996 is printed 1.000).
    """
    if round(lower, digits) <= 1.0 <= round(upper, digits):
        return "within noise"
    return "slower" if median > 1 else "faster"


def ratio_rows(times):
    """For each of RATIOS: its name, the per-round ratios' spread and the median's interval."""
    rows = []
    for variant, baseline, name in RATIOS:
        per_round = np.asarray(times[variant]) / np.asarray(times[baseline])
        rows.append((name, spread(per_round), median_interval(per_round)))
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
    parser.add_argument("--model", choices=("mlp", "cnn", "seq", "heads"), default="mlp",
                        help="mlp: 0.3M weights, tiny steps (the worst case for "
                        "per-step overhead); cnn: small conv net on 32x32 images; "
                        "seq: masked embedding + GRU tagger on padded sequences; heads: the "
                        "same with a per-token and a per-sequence head (an accumulator per "
                        "output)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="cpu (default): the process's CPU time, which a virtual "
                        "machine's steal time and other processes do not inflate; "
                        "wall: elapsed time")
    parser.add_argument("--threads", type=int, default=1,
                        help="TensorFlow intra- and inter-op threads (default 1: the "
                        "work per step, without thread pools spinning; 0: TensorFlow's "
                        "default)")
    parser.add_argument("--memory-of", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    x, y = load_data(args.samples, args.model)
    if args.memory_of:
        measure_memory_of(args.memory_of, args, x, y)
        return

    device = "GPU" if tf.config.list_physical_devices("GPU") else f"CPU ({os.cpu_count()} cores)"
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {device}; "
          f"{args.samples} samples, "
          f"{MODELS.get(args.model) or f'MLP 64-{args.width}x{args.depth}-10'}, "
          f"micro-batch {args.micro_batch}, accumulation_steps {args.steps}, "
          f"{args.rounds} alternating rounds; {args.clock} time, "
          f"{args.threads or 'default'} TensorFlow thread(s)")
    times = time_variants(args, x, y)
    memory = {} if args.no_memory else {v: peak_memory_mb(v, args) for v in VARIANTS}
    print()
    print("| variant | epoch s: median (min-max) | peak memory MB |")
    print("|---|---:|---:|")
    for variant in VARIANTS:
        median, low, high = spread(times[variant])
        mem = f"{memory[variant]:.0f}" if memory else "-"
        print(f"| {variant} | {median:.3f} ({low:.3f}-{high:.3f}) | {mem} |")
    rows = ratio_rows(times)
    print()
    print(f"Ratios of the two epochs of each round, over {args.rounds} rounds: their "
          "median, a 95% bootstrap interval of that median, and the range of the rounds. "
          "\"within noise\": the interval holds 1.")
    print()
    print("| ratio | median | 95% interval | min-max of rounds | verdict |")
    print("|---|---:|---:|---:|---|")
    for name, (median, low, high), (lower, upper) in rows:
        print(f"| {name} | {median:.3f} | {lower:.3f}-{upper:.3f} | {low:.3f}-{high:.3f} "
              f"| {verdict(median, lower, upper)} |")


if __name__ == "__main__":
    main()
