"""tf_keras' legacy optimizers (`tf_keras.optimizers.legacy.*`) against the large batch.

A large share of TensorFlow 2 code trains with these (OptimizerV2); they
have no `build()`, which once crashed the first step. The models here are
tf_keras models, imported directly, in whichever Keras process runs the suite.
"""

import numpy as np
import pytest
from conftest import make_data

import tfaccum
from tfaccum import GradientAccumulationCallback

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


def max_diff(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


class KernelRecorder(tf_keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.kernels = []

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(np.array(self.model.layers[0].kernel))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_legacy_optimizer_step_for_step(name):
    x, y = make_data()  # 100 samples: micro-batches of 8 end with one of 4
    reference, ref_kernels = build(OPTIMIZERS[name]), KernelRecorder()
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[ref_kernels])
    model, kernels = build(OPTIMIZERS[name]), KernelRecorder()
    callback = GradientAccumulationCallback(accumulation_steps=4)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback, kernels])
    # After each update: micro-batches 4, 8, 12 and the flushed 13th of each epoch.
    after_updates = [k for i, k in enumerate(kernels.kernels) if i % 13 in (3, 7, 11, 12)]
    assert len(after_updates) == len(ref_kernels.kernels) == 8
    for step, (ours, theirs) in enumerate(zip(after_updates, ref_kernels.kernels)):
        np.testing.assert_allclose(ours, theirs, atol=TOL, err_msg=f"update {step + 1}")
    assert max_diff(reference, model) < TOL
    assert max_diff(build(OPTIMIZERS[name]), model) > 1e-3  # it trained
    assert int(model.optimizer.iterations) == callback.optimizer_steps == 8


@pytest.mark.parametrize("name", ["Adam", "LossScaleOptimizer(Adam)"])
def test_leftover_sample_weight_and_schedule(name):
    x, y = make_data()
    weights = np.linspace(0.1, 2.0, 100).astype("float32")
    # drop: training on the first 96 samples, with sample weights.
    reference = build(OPTIMIZERS[name])
    reference.fit(x[:96], y[:96], sample_weight=weights[:96], batch_size=32, epochs=2,
                  shuffle=False, verbose=0)
    model = build(OPTIMIZERS[name])
    callback = GradientAccumulationCallback(accumulation_steps=4, leftover="drop")
    model.fit(x, y, sample_weight=weights, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[callback])
    assert max_diff(reference, model) < TOL and callback.dropped_micro_steps == 2
    # carry: windows span epochs.
    stream = [(x[i:i + 8], y[i:i + 8]) for _ in range(2) for i in range(0, 100, 8)]
    reference = build(OPTIMIZERS[name])
    for start in range(0, len(stream), 4):
        window = stream[start:start + 4]
        reference.train_on_batch(np.concatenate([w[0] for w in window]),
                                 np.concatenate([w[1] for w in window]))
    model = build(OPTIMIZERS[name])
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
        GradientAccumulationCallback(accumulation_steps=4, leftover="carry")])
    assert max_diff(reference, model) < TOL


def test_learning_rate_schedules_count_updates():
    x, y = make_data()

    def optimizer():
        return legacy.SGD(tf_keras.optimizers.schedules.PiecewiseConstantDecay(
            [2, 5], [0.05, 0.02, 0.005]))

    reference = build(optimizer)
    reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    model = build(optimizer)
    callback = GradientAccumulationCallback(accumulation_steps=4)
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[callback])
    assert max_diff(reference, model) < TOL
    assert int(model.optimizer.iterations) == callback.optimizer_steps == 12


def test_mixed_precision_overflow_is_left_out():
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = make_data(n=32)
        y[10, 0] = 1e5  # overflows float16 in the second micro-batch
        model = build(OPTIMIZERS["LossScaleOptimizer(Adam)"])
        callback = GradientAccumulationCallback(accumulation_steps=4)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
        assert callback.nonfinite_skips == 1 and callback.optimizer_steps == 1
        assert float(model.optimizer.loss_scale) == 2**8 / 2
        keep = np.r_[0:8, 16:32]
        reference = build(OPTIMIZERS["LossScaleOptimizer(Adam)"])
        reference.fit(x[keep], y[keep], batch_size=24, epochs=1, shuffle=False, verbose=0)
        assert max_diff(reference, model) < 1e-5
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
