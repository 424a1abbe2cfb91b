"""`GradientAccumulationCallback`: exact large-batch training with `model.fit`."""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable

from tfaccum import _keras
from tfaccum import backend as backends
from tfaccum import checks
from tfaccum import epoch_log
from tfaccum.configuration import Configuration
from tfaccum.counts import Counters
from tfaccum.counts import with_counter_properties
from tfaccum.dashboard_writer import probe_log_dir
from tfaccum.fit_scope import FitScope
from tfaccum.reduction import Reduction
from tfaccum.schedule import AccumulationSchedule
from tfaccum.window_losses import window_loss_of

# Constructor arguments: the attribute that holds each (get_config, repr).
_OPTIONS = {
    "accumulation_steps": "accumulation_steps",
    "reduction": "reduction",
    "leftover": "leftover",
    "verbose": "verbose",
    "skip_nonfinite": "skip_nonfinite",
    "noise_scale": "noise_scale_option",
    "log_dir": "log_dir",
    "scalars": "scalars",
    "write_interval": "write_interval",
    "sparse_gradients": "sparse_gradients",
    "accumulator_dtype": "accumulator_dtype",
}


@with_counter_properties
class GradientAccumulationCallback(_keras.Callback):
    """Trains with micro-batches as if the batch were `accumulation_steps` times larger.

    At the start of `fit` the callback installs an `AccumulationHook`: the
    gradients of `accumulation_steps` micro-batches are summed and the
    optimizer updates once with the large batch's gradient;
    `optimizer.iterations` (and every learning-rate schedule) counts those
    updates. A model compiled with a `tfaccum.WindowLoss` (in-batch
    negatives) gets its loss over the whole window, by gradient caching.
    When `fit` ends the model is a plain Keras model again.

    Args:
        accumulation_steps: Micro-batches per update: an integer >= 1, a
            dict `{epoch: steps}` (from that epoch on; 1 before the smallest
            key), or a callable `epoch -> steps`.
        reduction: How a window's gradients are combined. `"auto"` weights
            each micro-batch by what its loss averages over (its samples, or
            the unmasked tokens where a Keras mask or `ignore_class` reaches
            the loss; custom losses say it with `tfaccum.count_items()`) and
            divides by the window's total: exactly the large batch. `"samples"`
            weights by samples, `"mean"` weights micro-batches equally (Keras'
            built-in), `"sum"` adds without dividing; a `tfaccum.Reduction`
            instance is your own. Defaults to `"auto"`.
        leftover: A window not full when an epoch ends: `"flush"` applies it
            before validation, `"carry"` keeps it for the next epoch (applied
            when `fit` ends), `"drop"` discards it (`dropped_micro_steps`).
            Defaults to `"flush"`.
        verbose: `1` prints each epoch's micro-steps, updates and leftover.
            Defaults to `0`.
        skip_nonfinite: Leave out of its window a micro-batch whose gradient
            holds a NaN or an infinity (`nonfinite_skips`; with replicas, that
            replica's share), halving a dynamic loss scale as Keras does.
            Defaults to `None`: on exactly under a `LossScaleOptimizer`.
        noise_scale: Estimate the gradient noise scale B_simple (McCandlish et
            al. 2018) from the gradients the window already has
            (`callback.noise_scale`, `callback.suggested_accumulation_steps`;
            with replicas, the first replica's shares are the small batches).
            Defaults to `None`: on for windows of 2 or more, off with a
            window-wide loss; `True` needs `accumulation_steps` > 1.
        log_dir: Directory for the "Accumulation" TensorBoard tab's summaries
            of every update and leftover event (with several workers, the
            chief's). Defaults to `None`.
        scalars: With `log_dir`, also write the applied gradient norm as a
            plain scalar (`accumulation/gradient_norm`). Defaults to `False`.
        write_interval: With `log_dir`, seconds after which recorded summaries
            are written even within an epoch. Defaults to `30`.
        sparse_gradients: `"rows"`: a sparse (embedding) gradient reaches the
            optimizer as the window's rows in one `IndexedSlices`, as the large
            batch's (memory: the looked-up rows); `"dense"`: summed into a dense
            accumulator (memory: the variable). Defaults to `"rows"` (`"dense"`,
            with a warning, under `jit_compile=True` and with replicas).
        accumulator_dtype: `"float32"` (float64 variables keep float64) or
            `"bfloat16"`: half the accumulators' memory under a pooling
            allocator (a GPU's, or `TF_CPU_ALLOCATOR_USE_BFC=true`; not the
            CPU's default one), each micro-step summed in float32 and rounded
            stochastically. Sparse rows stay float32. Refused with
            `tf.distribute` replicas. Defaults to `"float32"`.

    Attributes:
        counters: The last `fit`'s counters, one `tfaccum.counts.Counters` snapshot
            (`micro_steps`, `optimizer_steps`, `flushes`, `dropped_micro_steps`,
            `nonfinite_skips`, `samples`, `items`), each also a property.

    Example:

    ```python
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=8, epochs=3,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    # trained like batch_size=32
    ```
    """

    def __new__(cls, *args, **kwargs):
        checks.check_keywords_only(args, "accumulation_steps")
        # A misspelt keyword is named before Python says a required one is missing.
        checks.reject_unknown({k: v for k, v in kwargs.items() if k not in _OPTIONS},
                              list(_OPTIONS))  # `__init__` then takes only known ones
        return super().__new__(cls)

    def __init__(
        self,
        *,
        accumulation_steps: int | dict[int, int] | Callable[[int], int],
        reduction: str | Reduction = "auto",
        leftover: str = "flush",
        verbose: int = 0,
        skip_nonfinite: bool | None = None,
        noise_scale: bool | None = None,
        log_dir: str | os.PathLike | None = None,
        scalars: bool = False,
        write_interval: float = 30.0,
        sparse_gradients: str = "rows",
        accumulator_dtype: str = "float32",
    ):
        _keras.check_backend()
        super().__init__()
        self.schedule = AccumulationSchedule(accumulation_steps)
        self.accumulation_steps = accumulation_steps
        self.reduction = checks.check_reduction(reduction)
        self.leftover = checks.check_leftover(leftover)
        self.verbose = checks.check_verbose(verbose)
        self.skip_nonfinite = checks.check_skip_nonfinite(skip_nonfinite)
        self.noise_scale_option = checks.check_noise_scale(
            noise_scale, accumulation_steps, self.schedule.always_one)
        self.estimator = self.summaries = None  # made at the first fit that wants them
        self.log_dir = checks.check_log_dir(log_dir)
        self.scalars = checks.check_scalars(scalars, log_dir)
        self.write_interval = checks.check_write_interval(write_interval)
        self.sparse_gradients = checks.check_sparse_gradients(sparse_gradients)
        self.accumulator_dtype = checks.check_accumulator_dtype(accumulator_dtype)
        self._scope = FitScope(end_fit=self._end_fit, stop_fit=self._stop_fit)
        self._backend = None  # the model's, at `fit`
        self._epoch_open = False
        self._held = False

    @property
    def hook(self):
        """The `AccumulationHook` of the last `fit`: its counters and compiled step."""
        return self._scope.hook

    @property
    def counters(self):
        """The last `fit`'s counters, as one `Counters` snapshot (zeros before any)."""
        return Counters() if self.hook is None else self.hook.counters

    @property
    def noise_scale(self):
        """The smoothed gradient noise scale B_simple, or `None` until known."""
        return None if self.estimator is None else self.estimator.noise_scale

    @property
    def suggested_accumulation_steps(self):
        """`accumulation_steps` whose window is closest to `noise_scale`, or `None`."""
        return None if self.estimator is None else self.estimator.suggested_accumulation_steps()

    def get_config(self):
        return {name: getattr(self, attribute) for name, attribute in _OPTIONS.items()}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"GradientAccumulationCallback({args})"

    def on_train_begin(self, logs=None):
        model = self.model
        self._first_among_callbacks()
        self._backend = backend = backends.for_model(model)
        # Across workers the chief writes: every worker's rows are the same.
        writes = self.log_dir is not None and backend.writes_summaries(model)
        if writes:
            probe_log_dir(self.log_dir)
        configuration = Configuration.resolve(
            reduction=self.reduction, skip_nonfinite=self.skip_nonfinite,
            sparse_gradients=self.sparse_gradients, accumulator_dtype=self.accumulator_dtype,
            observers=backend.observer_kinds(model, noise_scale=self._wants_noise_scale(model),
                                             summaries=writes))
        hook = self._scope.reusable(model, configuration)  # a traced hook of an equal one
        if hook is not None:  # same model, same compile: no re-tracing
            if hook is not self.hook:
                self._adopt_observers(hook)
            self._scope.begin(hook, reinstall=True)
        else:
            hook = backend.make_hook(model, configuration, log_dir=self.log_dir,
                                     scalars=self.scalars, write_interval=self.write_interval)
            self.estimator, self.summaries = backend.estimator_of(hook), backend.summaries_of(hook)
            self._scope.begin(hook, reinstall=False)
        self._epoch_open = self._held = False
        self._last_batch = -1
        self._warned_long_window = False
        if self.summaries is not None:
            self._summary_headroom = self.summaries.capacity - (
                _keras.api_for(model).steps_per_execution(model))

    def _first_among_callbacks(self):
        """Refuses checkpoints that cannot resume accumulation; moves this callback
        first, so a window ends before any other callback's epoch-end work (a
        checkpoint, a backup) sees the weights, even in epochs of unknown length."""
        callbacks = _keras.fit_callback_list(self)
        if callbacks is None:
            return
        checks.check_fit_callbacks(callbacks.callbacks, self.schedule.always_one,
                                   self.accumulation_steps)
        if callbacks.callbacks[0] is not self:
            callbacks.callbacks.remove(self)
            callbacks.callbacks.insert(0, self)

    def _wants_noise_scale(self, model):
        if self.noise_scale_option is not None:
            return self.noise_scale_option
        # A window-wide loss has no micro-batch gradient to compare.
        return not self.schedule.always_one and window_loss_of(model) is None

    def _adopt_observers(self, hook):
        """Takes over the summaries and estimator of another callback's hook."""
        self.summaries = self._backend.summaries_of(hook)
        self.estimator = self._backend.estimator_of(hook)
        if self.summaries is not None:
            self.summaries.retarget(self.log_dir, scalars=self.scalars,
                                    write_interval=self.write_interval)
        if self.estimator is not None:
            self.estimator.restart()

    def on_epoch_begin(self, epoch, logs=None):
        try:
            steps = checks.check_noise_scale_at_epoch(
                self.schedule(epoch), epoch, self.noise_scale_option)
        except (TypeError, ValueError):
            self._scope.abandon()  # the error aborts `fit`
            raise
        self.hook.set_accumulation_steps(steps)
        epoch_steps = (self.params or {}).get("steps")
        if epoch_steps and steps > epoch_steps and not self._warned_long_window:
            self._warned_long_window = True
            warnings.warn(epoch_log.long_window_warning(steps, epoch_steps, self.leftover),
                          stacklevel=2)
        self._last_batch = -1
        if self.verbose:
            self._epoch_start = self.hook.counts.numpy()
        self._epoch_open = True

    def on_train_batch_end(self, batch, logs=None):
        if self.summaries is not None:
            # Write before the device buffer can fill (at most an update per
            # micro-step), or when it is time to: counted here, not read.
            self.summaries.on_batch_end(batch - self._last_batch, self._summary_headroom)
        self._last_batch = batch
        # The last batch of an epoch of known length: end the window before
        # any other callback's epoch-end work sees the weights.
        steps = (self.params or {}).get("steps")
        if self._epoch_open and steps and batch + 1 >= steps:
            self._end_epoch()

    def on_test_begin(self, logs=None):
        # Validation inside `fit` starts after the epoch's last batch.
        if self._epoch_open:
            self._end_epoch()

    def on_epoch_end(self, epoch, logs=None):
        if self._epoch_open:
            self._end_epoch()
        if self.summaries is not None:
            self.summaries.flush()
        self._last_batch = -1
        if self.verbose:
            now = self.hook.counts.numpy()
            _keras.print_msg("\n" + epoch_log.epoch_line(
                epoch, {name: now[name] - self._epoch_start[name] for name in now},
                self.hook.accumulation_steps, self.leftover, self._leftover_window,
                self.noise_scale, self.suggested_accumulation_steps))

    def on_train_end(self, logs=None):
        if self.hook is None or not self.hook.installed:
            return
        if not self._scope.fit_ended:
            self._end_fit()
        self._scope.retire()

    def hold_window(self):
        """Leaves the open window pending when this `fit` stops, as an interrupt
        does (`tfaccum.BackupAndRestore` stopping for SIGTERM: its backup holds it)."""
        self._held = True

    def _end_fit(self):
        """Applies or drops what is left when `fit` ends; the loop is over."""
        hook = self.hook
        if self._held:
            self._scope.end()
            self._stop_fit()
            return
        self._scope.end()
        window = hook.drop() if self.leftover == "drop" else hook.flush()
        action = "drop" if self.leftover == "drop" else "flush"
        self._log_leftover(action, window)
        if self.summaries is not None:
            self.summaries.flush()
        if self.verbose and window.micro_batches:
            _keras.print_msg("\n" + epoch_log.fit_end_line(action, window))

    def _stop_fit(self):
        """`fit` raised: the open window stays pending (the weights are the last update's)."""
        if self.summaries is not None:
            self.summaries.flush()

    def _end_epoch(self):
        self._epoch_open = False
        if self._held:
            self._leftover_window = self.hook.pending
            return
        # "carry" leaves the window open: what it holds is only reported.
        end = {"flush": self.hook.flush, "drop": self.hook.drop}.get(self.leftover)
        self._leftover_window = end() if end is not None else self.hook.pending
        self._log_leftover(self.leftover, self._leftover_window)

    def _log_leftover(self, policy, window):
        if self.summaries is not None and window.micro_batches:
            counters = self.hook.counters
            self.summaries.write_leftover(
                int(_keras.iterations(self.model.optimizer).numpy()), policy, window,
                micro_steps=counters.micro_steps, updates=counters.optimizer_steps,
                nonfinite=counters.nonfinite_skips)


# `__new__` takes anything, to name a positional or misspelt argument first;
# `help()` and `inspect` show `__init__`'s keywords.
_init = inspect.signature(GradientAccumulationCallback.__init__)
GradientAccumulationCallback.__signature__ = _init.replace(
    parameters=list(_init.parameters.values())[1:])  # without `self`
del _init
