"""How far each way of training with micro-batches ends from the large batch.

Trains the same model from the same weights on the same data (not shuffled):
once with batch N*B (the reference), then with micro-batches of B using
tfaccum, Keras' `Optimizer(gradient_accumulation_steps=N)`, and no
accumulation. Prints the largest absolute weight difference to the reference.
The data size leaves a short last micro-batch and a partial window per epoch,
as real data sets do.

    python benchmarks/exactness.py [--samples 100] [--micro-batch 8] [--steps 4]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfaccum import GradientAccumulationCallback  # noqa: E402

OPTIMIZERS = {
    "SGD": lambda **kw: keras.optimizers.SGD(0.05, **kw),
    "SGD momentum": lambda **kw: keras.optimizers.SGD(0.05, momentum=0.9, **kw),
    "Adam": lambda **kw: keras.optimizers.Adam(0.01, **kw),
    "AdamW + clipnorm": lambda **kw: keras.optimizers.AdamW(
        0.01, weight_decay=0.05, clipnorm=0.1, **kw
    ),
    "Adam + LR schedule": lambda **kw: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.01, 4, 0.5), **kw
    ),
}


def model_with(optimizer):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def distance(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    fit = dict(epochs=args.epochs, shuffle=False, verbose=0)
    micro, steps = args.micro_batch, args.steps

    print(f"{args.samples} samples, batch {micro * steps} vs {steps} x {micro}, "
          f"{args.epochs} epochs: largest |weight - large-batch weight|\n")
    print("| optimizer | tfaccum | Keras gradient_accumulation_steps | no accumulation |")
    print("|---|---:|---:|---:|")
    for name, make in OPTIMIZERS.items():
        reference = model_with(make())
        reference.fit(x, y, batch_size=micro * steps, **fit)
        ours = model_with(make())
        ours.fit(x, y, batch_size=micro, callbacks=[
            GradientAccumulationCallback(accumulation_steps=steps)], **fit)
        builtin = model_with(make(gradient_accumulation_steps=steps))
        builtin.fit(x, y, batch_size=micro, **fit)
        plain = model_with(make())
        plain.fit(x, y, batch_size=micro, **fit)
        print(f"| {name} | {distance(reference, ours):.1e} | "
              f"{distance(reference, builtin):.1e} | {distance(reference, plain):.1e} |")


if __name__ == "__main__":
    main()
