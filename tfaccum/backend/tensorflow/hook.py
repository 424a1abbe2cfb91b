"""The accumulating train step, installed on and removed from a compiled model.

`GradientAccumulationCallback` uses this for `fit`; it is public for loops
that drive the model themselves (`train_on_batch`, or `fit` without the
callback's epoch bookkeeping).

A micro-step flows one way: the step tracer (`step.py`) hands a `MicroBatch`
to the hook, which adds it to (or leaves it out of) the window state
(`window.py`); the devices (`devices.py`) ends a full window, the
optimizer applies it, and the observers see an `Update`.
"""

import tensorflow as tf

from tfaccum import checks
from tfaccum import interrupts
from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow import window_backup
from tfaccum.backend.tensorflow.accumulating_step import AccumulatingStep
from tfaccum.backend.tensorflow.window_loss.gradient_cache import CachingStep
from tfaccum.backend.tensorflow.host_ends import HostEnds
from tfaccum.backend.tensorflow.installation import ModelInstallation
from tfaccum.backend.tensorflow.observer_states import ObserverStates
from tfaccum.backend.tensorflow.rollback import StepRollback
from tfaccum.backend.tensorflow.step import StepError
from tfaccum.backend.tensorflow.window import WindowState
from tfaccum.backend.tensorflow.window_loss.checks import check_window_loss_meets
from tfaccum.window_losses import window_loss_of
from tfaccum.hook_front import HookFront


# Called from a traced step: autograph (tf_keras') must not convert contextlib.
_deferred_interrupts = tf.autograph.experimental.do_not_convert(interrupts.deferred)


class AccumulationHook(HookFront):
    """Makes a compiled model update its weights once per window of micro-batches.

    Creating the hook installs it: the gradients the model's `train_step`
    (Keras' or an override, applying through `self.optimizer` once per step)
    hands its optimizer are summed, and the optimizer updates once every
    `accumulation_steps` micro-batches with the large batch's gradient (the
    same values and type: a sparse one as the window's rows). A model
    compiled with a `tfaccum.WindowLoss` trains by gradient caching
    (`tfaccum.backend.tensorflow.window_loss.gradient_cache`). A window that is not full waits for
    `flush()` or `drop()`; `remove()` restores the plain model exactly.
    Counters are read from the device only when asked for: `hook.counters`
    (a `Counters`, all at once) or one by one as properties
    (`hook.micro_steps`, `optimizer_steps`, `flushes`, `dropped_micro_steps`,
    `nonfinite_skips`, `samples`, `items`).

    Args:
        model: A compiled Keras model.
        accumulation_steps: Integer >= 1, micro-batches per optimizer update.
            Change it between steps with `set_accumulation_steps()`.
        reduction: As `GradientAccumulationCallback`'s. Defaults to `"auto"`.
        skip_nonfinite: As `GradientAccumulationCallback`'s. Defaults to `None`.
        sparse_gradients: As `GradientAccumulationCallback`'s. Defaults to `"rows"`.
        accumulator_dtype: As `GradientAccumulationCallback`'s. Defaults to
            `"float32"`.
        observers: Internal: what watches the window (the summaries, the
            noise scale, `AccumBatchNormalization`'s statistics), which
            `install_accumulation_hook` and the callback pass.

    Example:

    ```python
    hook = tfaccum.install_accumulation_hook(model, accumulation_steps=4)
    for x_batch, y_batch in micro_batches:
        model.train_on_batch(x_batch, y_batch)
    hook.flush()   # apply a partial last window
    hook.remove()  # back to a plain Keras model
    ```

    It is also a context manager that flushes and removes itself on exit:

    ```python
    with tfaccum.install_accumulation_hook(model, accumulation_steps=4):
        model.fit(x, y, batch_size=8, epochs=3)
    ```
    """

    window_backup = window_backup  # what a backup holds of the hook (`window_state()`)

    def _make(self, model, api, configuration, observers, accumulation_steps):
        api = _keras_on_tf.api_for(model)  # the core's, with what only TensorFlow reads
        optimizer = model.optimizer
        self.model = model
        self.observers = list(observers)
        self._observed = ObserverStates()
        self.configuration = configuration
        strategy = model.distribute_strategy
        checks.check_accumulator_dtype_meets(configuration.accumulator_dtype, strategy)
        self.reduction = configuration.reduction
        self.skip_nonfinite = configuration.skips_nonfinite(
            _keras_on_tf.scales_loss_dynamically(optimizer))
        self.reduction.check(model)
        loss_share = api.replica_loss_share(model)
        # Rows cannot be kept under XLA (fixed shapes): dense, with a warning.
        sparse_rows = configuration.sparse_rows and not model.jit_compile
        self.state = WindowState(strategy, self.reduction, loss_share=loss_share,
                                 sparse_rows=sparse_rows,
                                 dtype=configuration.dense_dtype)
        self.counts = self.state.counts
        self.accumulators = self.state.accumulators
        # The step is chosen once: a window-wide loss keeps each micro-batch's
        # forward pass (gradient caching) and its window's end replays them;
        # any other model's step hands its gradients to the accumulators.
        self.window_loss = window_loss_of(model)
        if self.window_loss is not None:
            check_window_loss_meets(model, self.window_loss, configuration)
            self._step = CachingStep(model, self.state, self.observers)
        else:
            self._step = AccumulatingStep(
                model, self.state, self.observers, configuration,
                skip_nonfinite=self.skip_nonfinite,
                original_train_step=lambda: self.installation.original_train_step())
        self._devices = self._step.devices
        self._ends = HostEnds(model, self._devices)
        self.installation = ModelInstallation(model, self._train_step, self)
        self._rollback = StepRollback(model)
        self._devices.prepare()
        self.state.create_ahead(model, api)
        self.set_accumulation_steps(accumulation_steps)
        self._install()

    # -- installation ---------------------------------------------------

    def _install(self):
        # Observers first: a layer's window must be in place before the
        # train step traces.
        for observer in self.observers:
            observer.on_install(self)
        self._observed.make(self.observers)
        self._rollback.arm()
        self.installation.install()

    def _zero(self):
        self.state.zero()
        self._devices.zero()

    # -- configuration ----------------------------------------------------

    ops = tf  # the array namespace observers compute with

    def observer_state(self, observer):
        """`observer`'s state (`tfaccum.observing`): its variables, read where used."""
        return self._observed.read(observer)

    def set_observer_state(self, observer, entries):
        """Sets the entries of `observer`'s state given (inside the step, or now)."""
        self._observed.write(observer, entries)

    @property
    def accumulation_steps(self):
        """The window's length now: micro-batches per optimizer update."""
        return int(self.state.steps.numpy())

    def set_accumulation_steps(self, accumulation_steps):
        """Sets the window length used from the next micro-batch on."""
        self.state.steps.assign(checks.check_steps(accumulation_steps))

    # -- counters -----------------------------------------------------------

    @property
    def pending(self):
        """The `Window` accumulated but not yet applied.

        With several replicas its samples are summed over them: every worker
        must read it (as it must call `flush()` and `drop()`).
        """
        return self._ends.pending()

    # -- the per-step graph -------------------------------------------------------

    def _train_step(self, data):
        # Ctrl-C waits for the trace to end: raised inside TensorFlow's C
        # extensions while they build the graph, it can come out as a
        # SystemError ("bad argument to internal function").
        with _deferred_interrupts(), self._rollback.guard():  # a refusal leaves the model as it was
            try:
                return self._step.train_step(data)
            except StepError:
                self.uninstall()  # `fit` stops here; leave a plain model behind.
                raise

    # -- host-triggered window ends -----------------------------------------

    def flush(self):
        """Applies a partial window now, normalised by what it holds.

        Returns:
            The `Window` that was applied (`Window(0, 0)` if none was pending).
        """
        return self._ends.flush()

    def drop(self):
        """Discards a partial window; it is counted in `dropped_micro_steps`.

        Returns:
            The `Window` that was discarded.
        """
        return self._ends.drop()
