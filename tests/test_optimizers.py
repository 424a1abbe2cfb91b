"""Every optimizer of the Keras under test against the large batch, step for step.

The whole list (those this Keras has: Lion, Adafactor, Lamb, Muon appear in
later Keras 3 releases), so no optimizer is untested; tf_keras' legacy
optimizers are in test_legacy_optimizers.py.
"""

import numpy as np
import pytest
from conftest import keras
from conftest import make_data
from conftest import max_weight_diff

from tfaccum import GradientAccumulationCallback

TOL = 1e-5
NAMES = ["SGD", "RMSprop", "Adam", "AdamW", "Adadelta", "Adagrad", "Adamax", "Nadam", "Ftrl",
         "Adafactor", "Lion", "Lamb", "Muon"]
OPTIMIZERS = {name: getattr(keras.optimizers, name) for name in NAMES
              if getattr(keras.optimizers, name, None) is not None}
OPTIMIZERS["SGD-nesterov"] = lambda learning_rate: keras.optimizers.SGD(
    learning_rate, momentum=0.9, nesterov=True)
LEARNING_RATES = {"Adadelta": 1.0, "Ftrl": 0.1, "Adagrad": 0.1}


def build(name, seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(7, activation="tanh"),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=OPTIMIZERS[name](learning_rate=LEARNING_RATES.get(name, 0.01)),
                  loss="mse")
    return model


class KernelRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.kernels = []

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(np.array(self.model.layers[0].kernel))


def test_the_list_is_what_this_keras_has():
    assert {"SGD", "Adam", "AdamW", "RMSprop", "Nadam", "Ftrl", "Adafactor", "Lion"} <= set(
        OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_step_for_step(name):
    x, y = make_data()  # 100 samples: micro-batches of 8 end with one of 4, flushed
    reference, theirs = build(name), KernelRecorder()
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[theirs])
    model, ours = build(name), KernelRecorder()
    callback = GradientAccumulationCallback(accumulation_steps=4)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback, ours])
    after_updates = [ours.kernels[i] for i in (3, 7, 11, 12)]
    assert len(theirs.kernels) == 4 and callback.optimizer_steps == 4
    for step, (got, want) in enumerate(zip(after_updates, theirs.kernels)):
        np.testing.assert_allclose(got, want, atol=TOL, err_msg=f"update {step + 1}")
    assert max_weight_diff(reference, model) < TOL
    assert max_weight_diff(build(name), model) > 1e-4  # it trained
