"""Non-finite micro-batches are left out of their window, in float32 and float16."""

import numpy as np
import pytest

from reference import KERAS
from reference import compare
from reference import iterations
from reference import keras
from reference import make_data
from reference import make_model
from reference import max_weight_diff

from tfaccum import GradientAccumulationCallback


def poisoned_data(target=np.inf):
    """32 samples; the second micro-batch of 8 holds a target whose error's
    gradient 2 * (prediction - target) is not finite: an infinite one in
    float32, a finite one that overflows in float16 (max 65504, times the
    loss scale).
    """
    x, y = make_data(n=32)
    y[10, 0] = target
    return x, y


def scaled_adam():
    """Adam with a loss scale that these small models never overflow at.

    (Keras' default initial scale, 2**15, overflows them in float16 in the
    first steps, at different steps for micro-batches than for the large
    batch, which would hide what is compared.)
    """
    if KERAS == "tf_keras":
        return keras.mixed_precision.LossScaleOptimizer(
            keras.optimizers.Adam(0.01), initial_scale=2**8)
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2**8)


def loss_scale(optimizer):
    return optimizer.loss_scale if KERAS == "tf_keras" else optimizer.dynamic_scale


def without_second_micro_batch(x, y):
    keep = np.r_[0:8, 16:32]
    return x[keep], y[keep]


def test_left_out_micro_batch_float32():
    x, y = poisoned_data()
    model = make_model(optimizer="adam")
    callback = GradientAccumulationCallback(accumulation_steps=4, skip_nonfinite=True)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert callback.nonfinite_skips == 1
    assert callback.optimizer_steps == 1 and callback.micro_steps == 4
    reference = make_model(optimizer="adam")
    reference.fit(*without_second_micro_batch(x, y), batch_size=24, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(reference, model) < 1e-5


@pytest.mark.parametrize("reduction", ["auto", "mean"])
def test_a_window_opened_by_a_left_out_micro_batch_starts_empty(reduction):
    # Windows of 2 micro-batches of 8: the second window's first micro-batch is
    # left out, so its second one is the first to add (not onto what the
    # first window summed).
    x, y = make_data(n=32)
    y[20, 0] = np.inf
    result = compare(lambda: make_model(optimizer="sgd"), x, y, micro=8, steps=2, epochs=2,
                     left_out={(0, 2), (1, 2)},
                     callback_kwargs=dict(skip_nonfinite=True, reduction=reduction))
    assert result.callback.nonfinite_skips == 2 and result.callback.optimizer_steps == 4
    assert result.diff < 1e-5


def test_float32_default_lets_divergence_show():
    x, y = poisoned_data()
    model = make_model(optimizer="adam")
    callback = GradientAccumulationCallback(accumulation_steps=4)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert callback.nonfinite_skips == 0
    assert not all(np.isfinite(w).all() for w in model.get_weights())


def test_a_window_of_only_non_finite_micro_batches_makes_no_update():
    x, y = make_data(n=16)
    y[:, 0] = np.inf
    model = make_model(optimizer="sgd")
    callback = GradientAccumulationCallback(accumulation_steps=2, skip_nonfinite=True)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert callback.nonfinite_skips == 2 and callback.optimizer_steps == 0
    assert int(model.optimizer.iterations) == 0
    assert max_weight_diff(make_model(optimizer="sgd"), model) == 0


def test_a_flushed_window_of_only_non_finite_micro_batches_is_no_flush():
    # 40 samples, windows of 4 micro-batches of 8: the epoch's fifth and last
    # micro-batch is flushed alone, and it is left out, so nothing is applied.
    x, y = make_data(n=40)
    y[36, 0] = np.inf
    model = make_model(optimizer="sgd")
    callback = GradientAccumulationCallback(accumulation_steps=4, skip_nonfinite=True)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert callback.nonfinite_skips == 1 and callback.optimizer_steps == 1
    assert callback.flushes == 0 and int(model.optimizer.iterations) == 1


def test_mixed_precision_matches_the_large_batch(mixed_precision):
    x, y = make_data()
    reference = make_model(optimizer=scaled_adam)
    reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert iterations(reference) == 12  # no overflow skipped a step
    model = make_model(optimizer=scaled_adam)
    callback = GradientAccumulationCallback(accumulation_steps=4)
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[callback])
    assert callback.skip_nonfinite is None and callback.hook.skip_nonfinite is True
    assert callback.optimizer_steps == 12 == iterations(model)
    # float16 forward passes round differently per batch shape: 1e-4, not 1e-5
    # (2.6e-5 measured).
    assert max_weight_diff(reference, model) < 1e-4
    assert max_weight_diff(make_model(optimizer=scaled_adam), model) > 1e-2


def test_mixed_precision_overflow_is_left_out_and_lowers_the_scale(mixed_precision):
    x, y = poisoned_data(target=1e5)
    model = make_model(optimizer=scaled_adam)
    scale = 2.0**8
    callback = GradientAccumulationCallback(accumulation_steps=4)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert callback.nonfinite_skips == 1 and callback.optimizer_steps == 1
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert float(loss_scale(model.optimizer)) == scale / 2
    reference = make_model(optimizer=scaled_adam)
    reference.fit(*without_second_micro_batch(x, y), batch_size=24, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(reference, model) < 1e-5


def test_bad_skip_nonfinite():
    with pytest.raises(TypeError, match=r"`skip_nonfinite` must be None, True or False. Received: skip_nonfinite='yes'"):
        GradientAccumulationCallback(accumulation_steps=2, skip_nonfinite="yes")


def test_a_hook_installed_by_hand_before_the_first_fit_scales_as_the_callback(mixed_precision):
    # The LossScaleOptimizer is not built before the first `fit`: its loss
    # scale's variables do not exist yet when the hook is installed.
    from tfaccum import install_accumulation_hook

    x, y = poisoned_data(target=1e5)
    model = make_model(optimizer=scaled_adam)
    hook = install_accumulation_hook(model, accumulation_steps=4)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert hook.counters.nonfinite_skips == 1 and hook.counters.optimizer_steps == 1
    assert float(loss_scale(model.optimizer)) == 2.0**8 / 2
    reference = make_model(optimizer=scaled_adam)
    reference.fit(*without_second_micro_batch(x, y), batch_size=24, epochs=1, shuffle=False,
                  verbose=0)
    assert max_weight_diff(reference, model) < 1e-5
    hook.remove()
