"""An interrupt never costs the model: real signals, and other callbacks' exceptions, during `fit`.

Each interrupted `fit` must raise the user's exception, leave a model that
reads back finite and trains plainly, and hold the weights of its last
completed update (its open window stays pending, dropped when the model next
trains): the large batch's after as many updates (`reference.windows`).
Written for every backend; on JAX a step donates the state it is given, so
an interrupt between a step's dispatch and the assignment of its outputs
would delete the weights (`tfaccum.interrupts`).
"""

import os
import signal
import threading
import warnings

import numpy as np
import pytest

from reference import BACKEND
from reference import InterruptAt
from reference import all_finite
from reference import iterations
from reference import keras
from reference import make_data
from reference import make_model
from reference import max_diff
from reference import read_run
from reference import train_large_batches
from reference import windows

from tfaccum import dashboard_schema
from tfaccum import GradientAccumulationCallback

# 5 micro-batches of 8 an epoch, windows of 4: each epoch ends with a
# window of one micro-batch (flushed, or dropped), so an interrupt can land
# in a micro-step, a window's end or an epoch's flush.
N, MICRO, STEPS = 40, 8, 4
PER_EPOCH = N // MICRO
# Seeded spread of delays (seconds after `fit` starts, compiling included).
DELAYS = np.random.default_rng(52).uniform(0.2, 1.6, size=8).round(3).tolist()

jax_only = pytest.mark.skipif(
    BACKEND != "jax", reason="JAX's steps donate their inputs; TensorFlow's update "
    "variables in place and Keras' TensorFlow fit runs no end-of-fit work when it raises")


def build():
    return make_model(optimizer="adam", seed=3)


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """Python's own SIGINT handler, as a user's session has it (another test in the
    same worker, or the test runner, may have replaced it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class SignalAfter:
    """Sends the process SIGINT `delay` seconds after the block starts (a real
    signal, delivered to the main thread wherever it is)."""

    def __init__(self, delay):
        self.timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))

    def __enter__(self):
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.join()
        return False


class PressesAgain(keras.callbacks.Callback):
    """Sends SIGINT again if `fit` goes on long after the first, as a user would.

    CPython discards a KeyboardInterrupt that its handler raises inside a
    weakref callback or a `__del__` ("Exception ignored in ..."), with or
    without tfaccum; TensorFlow frees many objects that way, so a Ctrl-C can
    be lost there. The second is sent here, at a batch's end; the test still
    asserts that it interrupts `fit` and keeps the model.
    """

    def __init__(self, sender, after=200):
        super().__init__()
        self.sender, self.limit, self.seen, self.again = sender, after, 0, 0

    def on_train_batch_end(self, batch, logs=None):
        if self.sender.timer.finished.is_set():
            self.seen += 1
            if self.seen % self.limit == 0:
                assert self.again < 3, "SIGINT did not interrupt fit"
                self.again += 1
                os.kill(os.getpid(), signal.SIGINT)


def check_left_at_its_last_update(model, callback, x, y, leftover, log_dir=None):
    """The interrupted model holds the large batch's weights after as many
    updates as it completed, and trains plainly afterwards."""
    counters = callback.counters
    updates = counters.optimizer_steps
    assert iterations(model) == updates
    assert all_finite(model.get_weights())
    epochs = counters.micro_steps // PER_EPOCH + 1
    done = windows(N, MICRO, STEPS, epochs, leftover)[:updates]
    # Every completed micro-step is in an update, dropped, or pending.
    in_updates = sum(len(w) for w in done) // MICRO
    # No hook: the signal landed in `on_train_begin`, before the hook was
    # made (the plain `fit` below shows that none was left on the model).
    pending = 0 if callback.hook is None else callback.hook.pending.micro_batches
    assert pending < STEPS
    assert in_updates + counters.dropped_micro_steps + pending == counters.micro_steps
    reference = build()
    if done:
        train_large_batches(reference, x, y, done)
    assert max_diff(model, reference) < 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stale hook's removal warns
        model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert iterations(model) == updates + PER_EPOCH  # plain: every batch updates
    assert all_finite(model.get_weights())
    if log_dir is not None:
        series, _ = read_run(log_dir)
        steps = [s for s, _ in series.get(dashboard_schema.TAG_PREFIX + "applied_gradient_norm", [])]
        assert steps == list(range(1, updates + 1))  # none twice, none lost
    return updates


def interrupted_fit(delay, leftover, log_dir, noise_scale=None, **compile_kwargs):
    x, y = make_data(n=N)
    model = make_model(optimizer="adam", seed=3, **compile_kwargs) if compile_kwargs else build()
    callback = GradientAccumulationCallback(
        accumulation_steps=STEPS, leftover=leftover, log_dir=log_dir, noise_scale=noise_scale)
    with SignalAfter(delay) as sender, pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=MICRO, epochs=10**6, shuffle=False, verbose=0,
                  callbacks=[callback, PressesAgain(sender)])
    return model, callback, x, y


@pytest.mark.parametrize("trial", range(len(DELAYS)))
def test_sigint_during_fit_leaves_the_model_at_its_last_update(trial, tmp_path):
    # A covering of the options a signal can meet: leftover x log_dir.
    leftover = ("flush", "drop")[trial % 2]
    log_dir = str(tmp_path / "run") if trial % 4 >= 2 else None
    model, callback, x, y = interrupted_fit(DELAYS[trial], leftover, log_dir)
    check_left_at_its_last_update(model, callback, x, y, leftover, log_dir)


@jax_only
@pytest.mark.parametrize("trial", range(3))
def test_sigint_under_data_parallel_leaves_the_model_at_its_last_update(trial, tmp_path):
    leftover = ("flush", "drop")[trial % 2]
    log_dir = str(tmp_path / "run") if trial == 2 else None
    with keras.distribution.DataParallel().scope():
        model, callback, x, y = interrupted_fit(DELAYS[-1 - trial], leftover, log_dir)
    check_left_at_its_last_update(model, callback, x, y, leftover, log_dir)


@jax_only
@pytest.mark.parametrize("trial", range(3))
def test_sigint_while_a_window_runs_as_one_program_leaves_the_model_at_its_last_update(
        trial, tmp_path):
    # steps_per_execution=4: each epoch's first window runs as one compiled
    # program (after the first update; no observer), its fifth micro-batch on
    # its own.
    leftover = ("flush", "drop")[trial % 2]
    model, callback, x, y = interrupted_fit(DELAYS[trial + 2], leftover, None,
                                            noise_scale=False, steps_per_execution=STEPS)
    check_left_at_its_last_update(model, callback, x, y, leftover)


@pytest.mark.parametrize("epoch, batch", [(0, 2), (1, 3), (2, 4), (3, 0)])
def test_another_callbacks_exception_reaches_the_user_and_keeps_the_model(epoch, batch):
    # Mid-window, at a window's end, at the epoch's flush, at an epoch's start.
    x, y = make_data(n=N)
    model = build()
    callback = GradientAccumulationCallback(accumulation_steps=STEPS)
    error = RuntimeError("another callback failed")
    with pytest.raises(RuntimeError, match="another callback failed"):
        model.fit(x, y, batch_size=MICRO, epochs=10, shuffle=False, verbose=0,
                  callbacks=[callback, InterruptAt(epoch=epoch, batch=batch, error=error)])
    updates = check_left_at_its_last_update(model, callback, x, y, "flush")
    assert callback.counters.micro_steps == epoch * PER_EPOCH + batch + 1
    assert updates == 2 * epoch + (batch + 1) // STEPS + (batch + 1 == PER_EPOCH)


# -- JAX: a signal between a step's dispatch and the assignment of its outputs ------------


def signal_after(function):
    """`function`, sending SIGINT as soon as it returns: Python's handler runs at
    once, before the caller can take the outputs."""
    def call(*args):
        outputs = function(*args)
        os.kill(os.getpid(), signal.SIGINT)
        return outputs

    return call


@jax_only
@pytest.mark.parametrize("step, micro_steps", [
    ("accumulate", 2), ("normalize", 4), ("apply", 4), ("apply", 5)],
    ids=["micro-step", "window-end", "update", "epoch-flush"])
def test_a_signal_while_a_step_holds_donated_buffers_waits_for_its_outputs(step, micro_steps):
    x, y = make_data(n=N)
    model = build()
    callback = GradientAccumulationCallback(accumulation_steps=STEPS)

    class ArmAt(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == micro_steps - 1:
                compiled = callback.hook._compiled
                setattr(compiled, step, signal_after(getattr(compiled, step)))

    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0,
                  callbacks=[callback, ArmAt()])
    assert callback.counters.micro_steps == micro_steps
    updates = check_left_at_its_last_update(model, callback, x, y, "flush")
    assert updates == (micro_steps >= 4) + (micro_steps == 5)


@jax_only
def test_a_signal_in_train_on_batch_keeps_the_model():
    # Keras' `train_on_batch` writes its state back without a `finally`.
    import tfaccum

    x, y = make_data(n=N)
    model = build()
    hook = tfaccum.install_accumulation_hook(model, accumulation_steps=2)
    model.train_on_batch(x[:8], y[:8])
    hook._compiled.apply = signal_after(hook._compiled.apply)
    with pytest.raises(KeyboardInterrupt):
        model.train_on_batch(x[8:16], y[8:16])
    assert all_finite(model.get_weights())
    hook.remove()
    reference = build()
    train_large_batches(reference, x, y, [list(range(16))])
    assert max_diff(model, reference) < 1e-5
    model.train_on_batch(x[:8], y[:8])
    assert iterations(model) == 2


@jax_only
def test_end_of_fit_work_that_fails_on_the_way_out_is_a_warning(tmp_path):
    x, y = make_data(n=N)
    model = build()
    callback = GradientAccumulationCallback(accumulation_steps=STEPS, log_dir=str(tmp_path))

    class Fail(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                def unwritable():
                    raise OSError("disk full")
                callback.summaries.flush = unwritable
                raise KeyboardInterrupt

    with pytest.warns(UserWarning, match=r"stopped with KeyboardInterrupt.*OSError: disk full"):
        with pytest.raises(KeyboardInterrupt):
            model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0,
                      callbacks=[callback, Fail()])
    assert all_finite(model.get_weights())
