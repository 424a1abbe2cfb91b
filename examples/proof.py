"""The README's proof: how far from the large batch each way of training ends.

One MLP, 100 samples, Adam, 3 epochs, the same initial weights: the large
batch (32) is the target; micro-batches of 8 accumulated 4 at a time by
tfaccum, by Keras' own `gradient_accumulation_steps`, and not at all.

    python examples/proof.py                      # TensorFlow
    KERAS_BACKEND=jax python examples/proof.py    # or torch
"""

import keras
import numpy as np

import tfaccum

rng = np.random.default_rng(0)
x = rng.normal(size=(100, 8)).astype("float32")  # each epoch ends in a short window
y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(100, 1))).astype("float32")


def trained(batch_size, steps=None, callbacks=()):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=steps),
                  loss="mse")
    model.fit(x, y, batch_size=batch_size, epochs=3, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return np.concatenate([w.ravel() for w in model.get_weights()])


large = trained(32)
runs = {
    "tfaccum, 8 x 4": trained(8, callbacks=[
        tfaccum.GradientAccumulationCallback(accumulation_steps=4)]),
    "Keras' gradient_accumulation_steps=4, 8 x 4": trained(8, steps=4),
    "no accumulation, batch 8": trained(8),
}
print(f"Keras 3 on {keras.backend.backend()}: largest weight difference from batch 32")
print("| training | from the large batch |\n|---|---:|")
for name, weights in runs.items():
    print(f"| {name} | {np.abs(weights - large).max():.1e} |")
