"""The gradient noise scale B_simple (McCandlish et al. 2018, appendix A.1)."""

import math

import numpy as np
import pytest

from reference import keras
from reference import make_data
from reference import make_model

from tfaccum import GradientAccumulationCallback
from tfaccum.noise_scale import NoiseScaleEstimator
from tfaccum.observing import MicroStep
from tfaccum.observing import Update
from tfaccum.noise_scale import SMOOTHING


class HostHook:
    """What a backend's hook gives an observer, on the host with NumPy arrays."""

    ops = np

    def __init__(self):
        self.states = {}

    def observer_state(self, observer):
        return self.states.get(id(observer))

    def set_observer_state(self, observer, entries):
        self.states[id(observer)] = dict(self.states.get(id(observer), {}), **entries)


def test_estimators_by_hand():
    """The one estimator every backend runs, fed by hand (its state: NumPy arrays)."""
    estimator, hook = NoiseScaleEstimator(), HostHook()
    estimator.on_install(hook)
    hook.set_observer_state(estimator, estimator.initial())

    def tell(method, record):
        hook.set_observer_state(estimator, getattr(estimator, method)(estimator.state(), record))

    def window(norms, applied_square, samples=4):
        for norm in norms:
            tell("on_micro_step", MicroStep(mean_squared_norm=np.float32(norm**2),
                                            measured_items=np.int64(samples)))
        tell("on_apply", Update(mean_squared_norm=np.float32(applied_square),
                                window={"window_items": np.int64(samples * len(norms))}))

    # A window of two micro-batches of 4 samples, squared gradient norms 9 and 25,
    # whose normalised sum has norm 2: |G_small|^2 = (9 + 25) / 2 = 17,
    # |G_big|^2 = 4, B_small = 4, B_big = 8.
    window([3.0, 5.0], 4.0)
    gradient_square = (8 * 4 - 4 * 17) / (8 - 4)  # -9: a single window is noisy
    trace = (17 - 4) / (1 / 4 - 1 / 8)  # 104
    assert float(estimator.state()["gradient_square"]) == pytest.approx(gradient_square)
    assert float(estimator.state()["trace"]) == pytest.approx(trace)
    assert estimator.noise_scale is None  # |G|^2 <= 0: not defined yet
    # A second window, whose |G|^2 estimate (8 * 9 - 4 * 4) / 4 = 14 makes the
    # moving average positive: the two averages move separately, then divide.
    window([2.0, 2.0], 9.0)
    gradient_square = SMOOTHING * gradient_square + (1 - SMOOTHING) * ((8 * 9 - 4 * 4) / 4)
    trace = SMOOTHING * trace + (1 - SMOOTHING) * ((4 - 9) / (1 / 4 - 1 / 8))
    assert gradient_square < 0  # still undefined after two windows...
    assert estimator.noise_scale is None
    for _ in range(10):  # ...defined once enough windows pulled |G|^2 above 0
        window([2.0, 2.0], 9.0)
        gradient_square = SMOOTHING * gradient_square + (1 - SMOOTHING) * 14.0
        trace = SMOOTHING * trace + (1 - SMOOTHING) * ((4 - 9) / (1 / 4 - 1 / 8))
    assert gradient_square > 0
    assert estimator.noise_scale == pytest.approx(trace / gradient_square, rel=1e-5)
    assert estimator.micro_batch_size == 4.0
    # A window of one micro-batch gives no estimate.
    before = int(estimator.state()["windows"])
    window([1.0], 1.0)
    assert int(estimator.state()["windows"]) == before
    # A micro-batch that was not measured (weighed 0) adds no samples, nor a batch.
    tell("on_micro_step", MicroStep(mean_squared_norm=np.float32(0.0),
                                    measured_items=np.int64(0)))
    assert not estimator.state()["micro"].any()


def regression(n=2048, noise=1.0, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + noise * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def frozen_linear_model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")  # weights stay fixed
    return model


def exact_noise_scale(model, x, y):
    """tr(Sigma) / |G|^2 from every example's own gradient.

    The model is one `Dense(1)` under the squared error: an example's
    gradient is 2 (x.w + b - y) times (x, 1), on any backend.
    """
    kernel, bias = model.get_weights()
    residual = 2.0 * (x @ kernel + bias - y)
    per_example = np.concatenate([residual * x, residual], axis=1)
    mean = per_example.mean(axis=0)
    return ((per_example - mean) ** 2).sum(axis=1).mean() / (mean ** 2).sum()


@pytest.mark.parametrize("seed", [0, 1])
def test_estimate_agrees_with_per_example_gradients(seed):
    """At fixed weights the estimate matches the exact value within 35%.

    Why 35%: the moving averages (smoothing 0.95) weigh about
    (1 + 0.95) / (1 - 0.95) = 39 windows, and each window's estimate is noisy.
    Across 10 shuffling seeds on this problem the ratio estimate/exact had a
    standard deviation of 0.10 (range 0.86 to 1.22): 35% is about 3.5 of them.
    """
    x, y = regression()
    model = frozen_linear_model()
    exact = exact_noise_scale(model, x, y)
    keras.utils.set_random_seed(100 + seed)
    callback = GradientAccumulationCallback(accumulation_steps=8)
    model.fit(x, y, batch_size=8, epochs=4, shuffle=True, verbose=0, callbacks=[callback])
    assert callback.noise_scale == pytest.approx(exact, rel=0.35)
    assert callback.suggested_accumulation_steps == max(1, math.floor(callback.noise_scale / 8 + 0.5))


def test_noisier_data_has_a_larger_noise_scale():
    scales = []
    for noise in (0.1, 10.0):
        x, y = regression(noise=noise)
        model = frozen_linear_model()
        callback = GradientAccumulationCallback(accumulation_steps=8)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=True, verbose=0, callbacks=[callback])
        scales.append(callback.noise_scale)
        assert exact_noise_scale(model, x, y) == pytest.approx(callback.noise_scale, rel=0.35)
    assert scales[1] > 3 * scales[0]


def test_off_and_undefined():
    x, y = make_data()
    model = make_model()
    off = GradientAccumulationCallback(accumulation_steps=4, noise_scale=False)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[off])
    assert off.noise_scale is None and off.suggested_accumulation_steps is None
    one = GradientAccumulationCallback(accumulation_steps=1)  # default: no error, no estimate
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[one])
    assert one.noise_scale is None


def test_explicit_noise_scale_needs_two_batch_sizes():
    with pytest.raises(ValueError, match=r"needs `accumulation_steps` >= 2. Received: noise_scale=True with accumulation_steps=1"):
        GradientAccumulationCallback(accumulation_steps=1, noise_scale=True)
    x, y = make_data()
    model = make_model()
    callback = GradientAccumulationCallback(accumulation_steps={0: 4, 1: 1}, noise_scale=True)
    with pytest.raises(ValueError, match=r"noise_scale=True with accumulation_steps\(1\) = 1"):
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[callback])
    with pytest.raises(TypeError, match=r"`noise_scale` must be None, True or False. Received: noise_scale=1"):
        GradientAccumulationCallback(accumulation_steps=2, noise_scale=1)


def test_written_for_the_dashboard(tmp_path):
    from reference import read_run
    from test_summary import steps

    x, y = make_data()
    log_dir = str(tmp_path / "run")
    callback = GradientAccumulationCallback(accumulation_steps=4, log_dir=log_dir)
    make_model().fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    series, metas = read_run(log_dir)
    # Every update after the first full window has an estimate; the rest
    # (undefined) are not written.
    written = steps(series, "noise_scale")
    assert written and set(written) <= set(range(1, 9))
    last = float(series["accumulation/noise_scale"][-1][1])
    assert last == pytest.approx(callback.noise_scale, rel=1e-5)
