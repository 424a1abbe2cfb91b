"""tf_keras' legacy optimizers (`tf_keras.optimizers.legacy.*`) against the large batch.

A large share of TensorFlow 2 code trains with these (OptimizerV2); they
have no `build()`, which once crashed the first step. The models here are
tf_keras models, imported directly, in whichever Keras process runs the suite.
"""

import numpy as np
import pytest

from reference import compare
from reference import make_data

import tfaccum
from tfaccum import GradientAccumulationCallback

pytestmark = pytest.mark.backend(
    "tensorflow",
    reason="tf_keras' optimizers")

tf_keras = pytest.importorskip("tf_keras")  # part of the test extra
legacy = tf_keras.optimizers.legacy

TOL = 1e-5
OPTIMIZERS = {
    "SGD": lambda: legacy.SGD(0.05),
    "SGD-momentum-nesterov": lambda: legacy.SGD(0.05, momentum=0.9, nesterov=True),
    "Adam": lambda: legacy.Adam(0.01),
    "RMSprop": lambda: legacy.RMSprop(0.01),
    "Adagrad": lambda: legacy.Adagrad(0.1),
    "Adadelta": lambda: legacy.Adadelta(1.0),
    "Adamax": lambda: legacy.Adamax(0.01),
    "Nadam": lambda: legacy.Nadam(0.01),
    "Ftrl": lambda: legacy.Ftrl(0.1),
    "LossScaleOptimizer(Adam)": lambda: tf_keras.mixed_precision.LossScaleOptimizer(
        legacy.Adam(0.01), initial_scale=2**8),
}


def build(optimizer, seed=1):
    tf_keras.utils.set_random_seed(seed)
    model = tf_keras.Sequential([
        tf_keras.Input((5,)),
        tf_keras.layers.Dense(7, activation="tanh"),
        tf_keras.layers.Dense(1),
    ])
    model.compile(optimizer=optimizer(), loss="mse")
    return model


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_legacy_optimizer_step_for_step(name):
    x, y = make_data()  # 100 samples: micro-batches of 8 end with one of 4
    pair = compare(lambda: build(OPTIMIZERS[name]), x, y, micro=8, steps=4, epochs=2)
    # After each update: micro-batches 4, 8, 12 and the flushed 13th of each epoch.
    assert len(pair.ours) == len(pair.theirs) == 8
    assert pair.diff < TOL
    assert pair.moved(lambda: build(OPTIMIZERS[name])) > 1e-3  # it trained
    assert int(pair.model.optimizer.iterations) == pair.callback.optimizer_steps == 8


@pytest.mark.parametrize("name", ["Adam", "LossScaleOptimizer(Adam)"])
def test_leftover_sample_weight_and_schedule(name):
    x, y = make_data()
    weights = np.linspace(0.1, 2.0, 100).astype("float32")
    # drop: training on the first 96 samples, with sample weights.
    pair = compare(lambda: build(OPTIMIZERS[name]), x, y, micro=8, steps=4, epochs=2,
                   leftover="drop", sample_weight=weights)
    assert pair.diff < TOL and pair.callback.dropped_micro_steps == 2
    # carry: windows span epochs.
    pair = compare(lambda: build(OPTIMIZERS[name]), x, y, micro=8, steps=4, epochs=2,
                   leftover="carry")
    assert pair.diff < TOL and len(pair.ours) == 7


def test_learning_rate_schedules_count_updates():
    x, y = make_data()

    def optimizer():
        return legacy.SGD(tf_keras.optimizers.schedules.PiecewiseConstantDecay(
            [2, 5], [0.05, 0.02, 0.005]))

    pair = compare(lambda: build(optimizer), x, y, micro=8, steps=4, epochs=3)
    assert pair.diff < TOL
    assert int(pair.model.optimizer.iterations) == pair.callback.optimizer_steps == 12


def test_mixed_precision_overflow_is_left_out():
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = make_data(n=32)
        y[10, 0] = 1e5  # overflows float16 in the second micro-batch
        pair = compare(lambda: build(OPTIMIZERS["LossScaleOptimizer(Adam)"]), x, y, micro=8,
                       steps=4, left_out=[(0, 1)])
        callback, model = pair.callback, pair.model
        assert callback.nonfinite_skips == 1 and callback.optimizer_steps == 1
        assert float(model.optimizer.loss_scale) == 2**8 / 2
        assert pair.diff < 1e-5
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")


def test_a_failed_first_step_leaves_no_hook():
    """An error at the first step (as the legacy crash was) leaves a plain model."""

    class Broken(tf_keras.Sequential):
        def train_step(self, data):
            raise RuntimeError("broken step")

    x, y = make_data(n=16)
    model = Broken([tf_keras.Input((5,)), tf_keras.layers.Dense(1)])
    model.compile(optimizer=legacy.SGD(0.1), loss="mse")
    with pytest.raises(RuntimeError, match="broken step"):
        model.fit(x, y, batch_size=8, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=2)])
    assert tfaccum.AccumulationHook.installed_on(model) is not None  # until the next call
    with pytest.warns(UserWarning, match="did not finish"):
        with pytest.raises(RuntimeError, match="broken step"):
            model.fit(x, y, batch_size=8, verbose=0)  # plain: the user's own error
    assert tfaccum.AccumulationHook.installed_on(model) is None
