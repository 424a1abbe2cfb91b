"""Batch 8 x 8 accumulated trains exactly like batch 64, on real data, offline.

Uses scikit-learn's bundled handwritten digits (1,797 8x8 images, shipped
inside the package: nothing is downloaded). Trains the same model twice from
the same initial weights, once with batch 64 and once with micro-batches of 8
accumulated 8 at a time, and prints how far apart the two end up.

    python examples/quickstart.py [--epochs 5] [--logdir runs/demo]

With --logdir it writes the Accumulation dashboard's summaries for two runs
(8 x 8 and, for comparison, 16 x 4 accumulated) and Keras' own loss curves;
then `tensorboard --logdir runs/demo` and open the Accumulation tab.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from tfaccum import GradientAccumulationCallback  # noqa: E402


def load_data():
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    split = 1400
    return (x[:split], y[:split]), (x[split:], y[split:])


def build_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--logdir", default=None, help="TensorBoard log directory")
    args = parser.parse_args()
    (x, y), validation = load_data()

    print("Training with batch_size=64 ...")
    large = build_model()
    start = time.perf_counter()
    large.fit(x, y, batch_size=64, epochs=args.epochs, shuffle=False,
              validation_data=validation, verbose=2)
    large_seconds = time.perf_counter() - start

    print("Training with batch_size=8 and accumulation_steps=8 ...")
    accumulated = build_model()
    log_dir = os.path.join(args.logdir, "8x8") if args.logdir else None
    accumulation = GradientAccumulationCallback(
        accumulation_steps=8, verbose=1, log_dir=log_dir)
    callbacks = [accumulation]
    if args.logdir:
        callbacks.append(keras.callbacks.TensorBoard(log_dir))
    start = time.perf_counter()
    accumulated.fit(x, y, batch_size=8, epochs=args.epochs, shuffle=False,
                    validation_data=validation, verbose=2, callbacks=callbacks)
    accumulated_seconds = time.perf_counter() - start

    difference = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(large.get_weights(), accumulated.get_weights())
    )
    _, large_accuracy = large.evaluate(*validation, verbose=0)
    _, accumulated_accuracy = accumulated.evaluate(*validation, verbose=0)
    print()
    print(f"{'':24}{'batch 64':>12}{'8 x 8 accumulated':>20}")
    print(f"{'optimizer updates':24}{int(large.optimizer.iterations):>12}"
          f"{int(accumulated.optimizer.iterations):>20}")
    print(f"{'validation accuracy':24}{large_accuracy:>12.4f}{accumulated_accuracy:>20.4f}")
    print(f"{'seconds':24}{large_seconds:>12.1f}{accumulated_seconds:>20.1f}")
    print(f"micro-steps {accumulation.micro_steps}, optimizer steps "
          f"{accumulation.optimizer_steps}, flushes {accumulation.flushes}")
    print(f"largest weight difference: {difference:.2e}")
    if difference > 1e-4:
        raise SystemExit("accumulated training diverged from the large batch")
    if args.logdir:
        print("Training with batch_size=16 and accumulation_steps=4, for the dashboard ...")
        log_dir = os.path.join(args.logdir, "16x4")
        build_model().fit(x, y, batch_size=16, epochs=args.epochs, shuffle=False,
                          validation_data=validation, verbose=0, callbacks=[
                              GradientAccumulationCallback(accumulation_steps=4, log_dir=log_dir),
                              keras.callbacks.TensorBoard(log_dir)])
        print(f"Summaries written to {args.logdir}: open TensorBoard's Accumulation tab.")


if __name__ == "__main__":
    main()
