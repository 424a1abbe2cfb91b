"""Where features meet: each case here was a bug once (issue 11)."""

import warnings

import numpy as np
import pytest

from reference import InterruptAt
from reference import KERAS
from reference import keras
from reference import make_data
from reference import make_model
from reference import max_weight_diff
from reference import not_on_torch
from test_noise_scale import frozen_linear_model
from test_noise_scale import regression

import tfaccum
from tfaccum import AccumulationHook
from tfaccum import GradientAccumulationCallback
from tfaccum import install_accumulation_hook
from tfaccum.noise_scale import NoiseScaleEstimator


def test_noise_scale_does_not_depend_on_the_reduction():
    """`reduction="sum"` once fed the estimator an unnormalised window (negative B_simple)."""
    x, y = regression(n=1024)
    scales = {}
    for reduction in ("samples", "mean", "sum"):
        model = frozen_linear_model()
        callback = GradientAccumulationCallback(accumulation_steps=8, reduction=reduction)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
        scales[reduction] = callback.noise_scale
    assert scales["samples"] > 0
    # Equal micro-batches: the three windows are one gradient up to a factor,
    # which B_simple (a ratio of squared norms) does not see.
    assert scales["sum"] == pytest.approx(scales["samples"], rel=1e-3)
    assert scales["mean"] == pytest.approx(scales["samples"], rel=1e-3)


@pytest.mark.backend("tensorflow", reason="on JAX the observers' device state is made anew at a "
                     "reinstalled hook's first step: there is none to read before")
def test_reinstall_resets_every_observer():
    x, y = make_data(n=16)
    model = make_model()
    estimator = NoiseScaleEstimator()
    hook = AccumulationHook.watched_by(model, [estimator], accumulation_steps=4)
    model.train_on_batch(x[:8], y[:8])
    model.train_on_batch(x[8:], y[8:])
    assert np.asarray(estimator.state()["micro"])[0] > 0  # half a window: sum b |g|^2
    with pytest.warns(UserWarning, match="discards 2 micro-batches"):
        hook.remove()
    hook.reinstall()
    assert not np.asarray(estimator.state()["micro"]).any()
    assert hook.pending == tfaccum.Window(0, 0) and hook.micro_steps == 0
    hook.remove()


@pytest.mark.keras3  # AccumBatchNormalization is Keras 3's
@not_on_torch("batch_norm")
def test_a_left_out_micro_batch_does_not_move_pooled_statistics():
    x, y = make_data(n=32)
    x = x * np.arange(1, 6, dtype="float32")
    poisoned = x.copy()
    poisoned[10, 2] = np.nan  # NaN activations, NaN gradients

    def bn_model(layer_class):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([
            keras.Input((5,)), layer_class(momentum=0.5), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    model = bn_model(tfaccum.AccumBatchNormalization)
    callback = GradientAccumulationCallback(accumulation_steps=4, skip_nonfinite=True)
    model.fit(poisoned, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert callback.nonfinite_skips == 1
    keep = np.r_[0:8, 16:32]
    reference = bn_model(keras.layers.BatchNormalization)
    reference.fit(x[keep], y[keep], batch_size=24, epochs=1, shuffle=False, verbose=0)
    # The moving statistics are those of the 24 samples left in the window
    # (gamma and beta train on micro-batch statistics: not comparable).
    for name in ("moving_mean", "moving_variance"):
        ours = np.asarray(getattr(model.layers[0], name))
        assert np.isfinite(ours).all()
        np.testing.assert_allclose(ours, getattr(reference.layers[0], name), atol=1e-5)


def test_carried_window_is_applied_before_the_ema_is_written():
    """Keras writes the EMA into the weights before `on_train_end`."""
    x, y = make_data()

    def optimizer():
        return keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9)

    epochs = 2
    micro_batches = [(x[i:i + 8], y[i:i + 8]) for _ in range(epochs) for i in range(0, 100, 8)]
    reference = make_model(optimizer=optimizer)
    for start in range(0, len(micro_batches), 4):  # 26 micro-batches: the last window holds 2
        window = micro_batches[start:start + 4]
        reference.train_on_batch(np.concatenate([w[0] for w in window]),
                                 np.concatenate([w[1] for w in window]))
    reference.optimizer.finalize_variable_values(reference.trainable_variables)
    model = make_model(optimizer=optimizer)
    callback = GradientAccumulationCallback(accumulation_steps=4, leftover="carry")
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=[callback])
    assert callback.optimizer_steps == 7 and callback.flushes == 1
    assert max_weight_diff(reference, model) < 1e-5


# -- summaries ------------------------------------------------------------------


def summary_steps(log_dir):
    from reference import read_run
    from test_summary import steps

    return steps(read_run(log_dir)[0], "applied_gradient_norm")


@pytest.mark.backend("tensorflow", reason="TensorFlow's summaries record rows in a device buffer "
                     "of `capacity` rows; JAX's wait on the host and none is lost")
def test_a_full_summary_buffer_loses_rows_it_does_not_overwrite(tmp_path):
    from tfaccum.backend.tensorflow.summary import AccumulationSummaries

    x, y = make_data(n=48)
    model = make_model()
    summaries = AccumulationSummaries(str(tmp_path / "run"), capacity=4)
    hook = AccumulationHook.watched_by(model, [summaries], accumulation_steps=1)
    for i in range(0, 48, 8):  # 6 updates, nothing written in between
        model.train_on_batch(x[i:i + 8], y[i:i + 8])
    with pytest.warns(UserWarning, match=r"2 optimizer updates' summaries found the device buffer of 4 rows full"):
        summaries.write()
    assert summaries.lost_rows == 2
    hook.remove()
    assert summary_steps(str(tmp_path / "run")) == [1, 2, 3, 4]  # not 1, 2, 3, 6


@pytest.mark.parametrize("same_callback", [True, False], ids=["same-callback", "new-callback"])
def test_summaries_of_an_interrupted_fit_are_kept(tmp_path, same_callback):
    x, y = make_data(n=160)
    log_dir = str(tmp_path / "run")
    model = make_model()
    callback = GradientAccumulationCallback(accumulation_steps=2, log_dir=log_dir)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[callback, InterruptAt(batch=13, error=KeyboardInterrupt())])  # 7 updates, unwritten
    again = callback if same_callback else GradientAccumulationCallback(
        accumulation_steps=2, log_dir=log_dir)
    with pytest.warns(UserWarning, match="did not finish"):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[again])
    written = summary_steps(log_dir)
    if not same_callback:
        # Two writers, two event files, read in name order: made in one
        # second, TensorFlow names them by a per-process counter, and "10"
        # sorts before "9". The dashboard orders by step.
        written = sorted(written)
    assert written == list(range(1, 18))  # 7 + 10 updates, none lost, none twice


# -- a failed fit leaves a plain model ---------------------------------------------


class RaiseAt(keras.callbacks.Callback):
    def __init__(self, error):
        super().__init__()
        self.error = error

    def on_train_batch_end(self, batch, logs=None):
        if batch == 4:
            raise self.error


def failing_fit(model, cause, tmp_path):
    x, y = make_data(n=80)
    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    if cause == "callback":
        callbacks = [GradientAccumulationCallback(accumulation_steps=4), RaiseAt(RuntimeError("boom"))]
        error = RuntimeError
    elif cause == "keyboard":
        callbacks = [GradientAccumulationCallback(accumulation_steps=4), RaiseAt(KeyboardInterrupt())]
        error = KeyboardInterrupt
    elif cause == "schedule":
        def schedule(epoch):
            if epoch == 1:
                raise RuntimeError("schedule failed")
            return 4
        callbacks = [GradientAccumulationCallback(accumulation_steps=schedule)]
        error = RuntimeError
    elif cause == "log_dir":
        log_dir = tmp_path / "logs"
        callbacks = [GradientAccumulationCallback(accumulation_steps=4, log_dir=log_dir)]
        log_dir.write_text("a file where the directory should be")
        error = Exception
    with pytest.raises(error):
        model.fit(x, y, callbacks=callbacks, **fit)


@pytest.mark.parametrize("cause", ["callback", "keyboard", "schedule", "log_dir"])
def test_after_a_failed_fit_the_model_trains_plainly(cause, tmp_path):
    x, y = make_data(n=80)
    model = make_model()
    failing_fit(model, cause, tmp_path)
    before = int(model.optimizer.iterations)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stale hook's removal may warn
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) - before == 10  # every batch updated
    assert AccumulationHook.installed_on(model) is None
    assert "fit" not in model.__dict__ and "train_step" not in model.__dict__
    model.train_on_batch(x[:8], y[:8])
    assert int(model.optimizer.iterations) - before == 11
    # And it trains like a model that never saw the callback.
    reference = make_model()
    reference.set_weights(model.get_weights())
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    reference.optimizer.build(reference.trainable_variables)
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(reference, model) < 1e-6


def test_train_on_batch_after_a_failed_fit_is_plain(tmp_path):
    x, y = make_data(n=8)
    model = make_model()
    failing_fit(model, "keyboard", tmp_path)
    before = int(model.optimizer.iterations)
    with pytest.warns(UserWarning, match="did not finish"):
        model.train_on_batch(x, y)
    assert int(model.optimizer.iterations) == before + 1


def test_a_hand_installed_hook_keeps_its_lifetime():
    x, y = make_data(n=80)
    model = make_model()
    hook = install_accumulation_hook(model, accumulation_steps=5)
    with pytest.raises(RuntimeError):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[RaiseAt(RuntimeError("boom"))])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert AccumulationHook.installed_on(model) is hook
    assert hook.optimizer_steps == 3  # 5 + 10 micro-steps, windows of 5
    hook.remove()


def test_a_users_instance_attributes_come_back():
    x, y = make_data()
    model = make_model()
    method = "apply" if KERAS == "keras3" else "apply_gradients"
    own = getattr(model.optimizer, method)
    traced = []

    def logged(*args, **kwargs):
        traced.append(1)  # Python side effect: once per trace
        return own(*args, **kwargs)

    setattr(model.optimizer, method, logged)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    assert model.optimizer.__dict__[method] is logged  # put back, not deleted
    assert traced  # the window was applied through the user's own method
    assert int(model.optimizer.iterations) == 4


# -- errors raised early, by name ---------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(log_dir=""), ValueError, r"`log_dir` must name a directory; pass None for no summaries. Received: log_dir=''"),
        (dict(accumulation_steps=2**63), ValueError, r"below 2\*\*63.*Received: accumulation_steps=9223372036854775808"),
        (dict(verbose=True), ValueError, r"`verbose` must be 0 or 1. Received: verbose=True"),
        (dict(verbose=1.0), ValueError, r"`verbose` must be 0 or 1. Received: verbose=1.0"),
        (dict(verbose=np.array([1])), ValueError, r"`verbose` must be 0 or 1. Received: verbose=array\(\[1\]\)"),
        (dict(accumulation_steps=lambda: 4), TypeError, r"called with the epoch.*Received: accumulation_steps=<function .*> with signature \(\)"),
        (dict(accumulation_steps=lambda a, b: 4), TypeError, r"with signature \(a, b\)"),
        (dict(write_interval=0), ValueError, r"`write_interval` must be a number of seconds > 0. Received: write_interval=0"),
        (dict(sparse_gradients="sparse"), ValueError, r"`sparse_gradients` must be one of 'rows', 'dense'. Received: sparse_gradients='sparse'"),
        (dict(log_dir="logs/a\x00b"), ValueError, r"`log_dir` must not hold a NUL character. Received: log_dir='logs/a\\x00b'"),
        (dict(leftover=np.array([1, 2])), ValueError, r"`leftover` must be one of 'flush', 'carry', 'drop'. Received: leftover=array\(\[1, 2\]\)"),
        (dict(reduction=np.array(["auto"])), ValueError, r"`reduction` must be one of .*Received: reduction=array\(\['auto'\]"),
    ],
)
def test_bad_input_is_refused_by_name(kwargs, error, message):
    kwargs.setdefault("accumulation_steps", 2)
    with pytest.raises(error, match=message):
        GradientAccumulationCallback(**kwargs)


def test_an_unwritable_log_dir_is_refused_at_construction(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"`log_dir` must be a directory tfaccum can create.*is not a directory. Received: log_dir="):
        GradientAccumulationCallback(accumulation_steps=2, log_dir=blocker / "logs")
    assert not (tmp_path / "ok").exists()
    GradientAccumulationCallback(accumulation_steps=2, log_dir=tmp_path / "ok" / "deeper")


def test_a_log_dir_that_cannot_hold_files_is_refused_before_training(tmp_path):
    log_dir = tmp_path / "logs"
    callback = GradientAccumulationCallback(accumulation_steps=2, log_dir=log_dir)
    log_dir.write_text("a file where the directory should be")  # after the constructor's check
    model = make_model()
    before = model.get_weights()
    x, y = make_data(n=16)
    with pytest.raises(ValueError, match=r"`log_dir` cannot hold the summaries: .*Received: log_dir="):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[callback])
    assert int(model.optimizer.iterations) == 0  # not one batch trained
    assert max(np.abs(a - b).max() for a, b in zip(before, model.get_weights())) == 0
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # and the model trains plainly
    assert int(model.optimizer.iterations) == 4


def test_install_on_something_that_is_no_model():
    with pytest.raises(TypeError, match=r"`model` must be a compiled Keras model.*Received: model='model' \(of type str\)"):
        install_accumulation_hook("model", accumulation_steps=2)
    with pytest.raises(TypeError, match=r"`model` must be a compiled Keras model"):
        tfaccum.remove_accumulation_hook(None)


def test_removing_the_hook_inside_fit_is_a_clear_error():
    x, y = make_data(n=32)
    model = make_model()

    class Remover(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            tfaccum.remove_accumulation_hook(self.model)

    with pytest.raises(RuntimeError, match=r"cannot be removed while its `fit` is running.*model.stop_training = True"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[
            GradientAccumulationCallback(accumulation_steps=2), Remover()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=8, verbose=0)  # plain again
    assert AccumulationHook.installed_on(model) is None


def test_mixed_bfloat16_is_close_to_the_large_batch():
    # bfloat16 forward passes round differently per batch shape (8 bits of
    # mantissa): one device accumulating is 7.7e-4 from its large batch on
    # TensorFlow; the bound is the same on every backend.
    from reference import compare

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        x, y = make_data()
        result = compare(lambda: make_model(optimizer="adam"), x, y, micro=8, steps=4, epochs=2)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert result.diff < 2e-3
    assert result.moved(lambda: make_model(optimizer="adam")) > 1e-2
