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
    """The `AccumulationHook` on TensorFlow (Keras 3 and tf_keras): see `HookFront`.

    A model compiled with a `tfaccum.WindowLoss` trains by gradient caching
    (`tfaccum.backend.tensorflow.window_loss.gradient_cache`); a sparse
    gradient is applied as the window's rows.
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
        return int(self.state.steps.numpy())

    def set_accumulation_steps(self, accumulation_steps):
        self.state.steps.assign(checks.check_steps(accumulation_steps))

    # -- counters -----------------------------------------------------------

    @property
    def pending(self):
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
        return self._ends.flush()

    def drop(self):
        return self._ends.drop()
