"""Epoch time and peak memory: tfaccum vs Keras' own accumulation vs plain training.

All variants train the same model on the same data in one run, alternating
round by round so that machine noise hits them alike. Epoch times are the
median over rounds, after one warm-up epoch per variant (tracing).

    python benchmarks/throughput.py [--micro-batch 8] [--steps 8] [--rounds 5]

Variants:
  tfaccum      batch B, GradientAccumulationCallback(accumulation_steps=N)
               (defaults: the noise scale is estimated)
  tfaccum-no-noise  the same with noise_scale=False
  tfaccum+log_dir  the defaults, writing Accumulation summaries to a temporary dir
  keras        batch B, optimizer(gradient_accumulation_steps=N)
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
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfaccum import GradientAccumulationCallback  # noqa: E402

VARIANTS = ("tfaccum", "tfaccum-no-noise", "tfaccum+log_dir", "keras", "micro", "large")


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
    extra = {"gradient_accumulation_steps": args.steps} if variant == "keras" else {}
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
    models = {variant: build(variant, args) for variant in VARIANTS}
    times = {variant: [] for variant in VARIANTS}
    for round_ in range(args.rounds + 1):  # round 0 warms up (tracing)
        for variant in VARIANTS:
            model, batch_size, callbacks = models[variant]
            timer = EpochTimer()
            model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0,
                      callbacks=callbacks + [timer])
            if round_:
                times[variant].append(timer.seconds[0])
    return {variant: statistics.median(t) for variant, t in times.items()}


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
    parser.add_argument("--rounds", type=int, default=5)
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
          f"median of {args.rounds} epochs")
    seconds = time_variants(args, x, y)
    memory = {} if args.no_memory else {v: peak_memory_mb(v, args) for v in VARIANTS}
    print()
    print("| variant | epoch s | vs keras accumulation | vs plain micro-batch | peak memory MB |")
    print("|---|---:|---:|---:|---:|")
    for variant in VARIANTS:
        mem = f"{memory[variant]:.0f}" if memory else "-"
        print(f"| {variant} | {seconds[variant]:.3f} | "
              f"{seconds[variant] / seconds['keras']:.2f} | "
              f"{seconds[variant] / seconds['micro']:.2f} | {mem} |")
    print(f"\nnoise scale cost: {seconds['tfaccum'] / seconds['tfaccum-no-noise']:.3f}x tfaccum without it")
    print(f"log_dir cost: {seconds['tfaccum+log_dir'] / seconds['tfaccum']:.3f}x tfaccum without it")


if __name__ == "__main__":
    main()
