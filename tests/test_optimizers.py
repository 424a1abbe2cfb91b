"""Every optimizer of the Keras under test against the large batch, step for step.

The whole list (those this Keras has: Lion, Adafactor, Lamb, Muon appear in
later Keras 3 releases), so no optimizer is untested; tf_keras' legacy
optimizers are in test_legacy_optimizers.py.
"""

import pytest

from reference import compare
from reference import keras
from reference import make_data
from reference import make_model

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


def test_the_list_is_what_this_keras_has():
    assert {"SGD", "Adam", "AdamW", "RMSprop", "Nadam", "Ftrl", "Adafactor", "Lion"} <= set(
        OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_step_for_step(name):
    x, y = make_data()  # 100 samples: micro-batches of 8 end with one of 4, flushed
    pair = compare(lambda: build(name), x, y, micro=8, steps=4)
    assert len(pair.theirs) == 4 and pair.callback.optimizer_steps == 4
    assert pair.diff < TOL
    assert pair.moved(lambda: build(name)) > 1e-4  # it trained


@pytest.mark.parametrize("clipping", [{"clipnorm": 0.05}, {"global_clipnorm": 0.05},
                                      {"clipvalue": 0.01}])
def test_clipping_acts_on_the_windows_gradient(clipping):
    # Tight enough that every update is clipped: a clip per micro-batch would differ.
    def build():
        return make_model(optimizer=lambda: keras.optimizers.Adam(0.01, **clipping))

    x, y = make_data(n=64)
    result = compare(build, x, y, micro=8, steps=4, epochs=2)
    assert result.diff < TOL
    assert result.moved(build) > 1e-2
