"""Accumulation under MirroredStrategy: gradient all-reduces and epoch time.

Two replicas (two logical CPUs, or the first two GPUs), one run: tfaccum
(plain, with the dashboard and the noise scale on, and under mixed_float16
with both on as well), plain micro-batch training (float32 and
mixed_float16) and the large batch, alternating epoch by epoch; Keras' own
`gradient_accumulation_steps` is tried too (it fails under MirroredStrategy
in graph mode, keras-team/keras#20582). Counts the cross-device reductions
actually run per epoch with an instrumented `cross_device_ops`.

    python benchmarks/distributed.py [--micro-batch 16] [--steps 8] [--rounds 5]
"""

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

if not tf.config.list_physical_devices("GPU"):
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * 2,
    )

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfaccum import GradientAccumulationCallback  # noqa: E402


class CountingReduction(tf.distribute.ReductionToOneDevice):
    """Counts, at run time, the cross-device reductions it performs."""

    count = None

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        reduced = super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)
        with tf.control_dependencies(tf.nest.flatten([getattr(v, "values", v) for v in reduced])):
            self.count.assign_add(1)
        return reduced


# name: (accumulate, callback options, mixed precision)
VARIANTS = {
    "tfaccum": (True, {}, False),
    "tfaccum + log_dir + noise_scale": (True, {"log_dir": True, "noise_scale": True}, False),
    "tfaccum mixed_float16 + log_dir + noise_scale": (
        True, {"log_dir": True, "noise_scale": True}, True),
    "keras": (False, {}, False),
    "micro": (False, {}, False),
    "micro mixed_float16": (False, {}, True),
    "large": (False, {}, False),
}


def build(variant, args, x, y):
    accumulate, options, mixed = VARIANTS[variant]
    gpus = tf.config.list_logical_devices("GPU")
    devices = [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))][:2]
    counter = CountingReduction()
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=counter)
    keras.mixed_precision.set_global_policy("mixed_float16" if mixed else "float32")
    with strategy.scope():
        counter.count = tf.Variable(0, dtype=tf.int64, trainable=False)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((x.shape[1],)),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(10, activation="softmax", dtype="float32"),
        ])
        extra = {"gradient_accumulation_steps": args.steps} if variant == "keras" else {}
        model.compile(optimizer=keras.optimizers.Adam(1e-3, **extra),
                      loss="sparse_categorical_crossentropy")
    keras.mixed_precision.set_global_policy("float32")
    batch = args.micro_batch * (args.steps if variant == "large" else 1)
    callbacks = []
    if accumulate:
        if options.get("log_dir"):
            options = dict(options, log_dir=tempfile.mkdtemp(prefix="tfaccum-bench-"))
        callbacks = [GradientAccumulationCallback(accumulation_steps=args.steps, **options)]
    return model, batch, callbacks, counter


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=16, help="global micro-batch")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 64)).astype("float32")
    y = rng.integers(0, 10, size=args.samples)
    variants = {}
    for variant in VARIANTS:
        model, batch, callbacks, counter = build(variant, args, x, y)
        try:
            model.fit(x[:batch * args.steps], y[:batch * args.steps], batch_size=batch,
                      epochs=1, verbose=0, callbacks=callbacks)  # trace
        except Exception as error:  # noqa: BLE001 - reported, not hidden
            print(f"{variant}: fails under MirroredStrategy: {type(error).__name__}: "
                  f"{str(error).splitlines()[0][:120]}")
            continue
        variants[variant] = (model, batch, callbacks, counter)
    seconds = {v: [] for v in variants}
    reductions = {}
    for _ in range(args.rounds):
        for variant, (model, batch, callbacks, counter) in variants.items():
            counter.count.assign(0)
            start = time.perf_counter()
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=callbacks)
            seconds[variant].append(time.perf_counter() - start)
            reductions[variant] = int(counter.count.numpy())
    micro_steps = -(-args.samples // args.micro_batch)
    print(f"\n2 replicas, {args.samples} samples, global micro-batch {args.micro_batch}, "
          f"accumulation_steps {args.steps} ({micro_steps} micro-steps per epoch), "
          f"median of {args.rounds} epochs\n")
    print("| variant | gradient all-reduces per epoch | epoch s (min-max) "
          "| vs plain micro-batch (same precision) |")
    print("|---|---:|---:|---:|")
    for variant in variants:
        times = seconds[variant]
        plain = "micro mixed_float16" if VARIANTS[variant][2] else "micro"
        median = statistics.median(times)
        print(f"| {variant} | {reductions[variant]} | {median:.3f} ({min(times):.3f}-"
              f"{max(times):.3f}) | {median / statistics.median(seconds[plain]):.2f} |")

if __name__ == "__main__":
    main()
