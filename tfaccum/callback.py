"""`GradientAccumulationCallback`: exact large-batch training with `model.fit`."""

from tfaccum import _keras
from tfaccum import checks
from tfaccum.hook import AccumulationHook
from tfaccum.configuration import Configuration
from tfaccum.counts import Counters
from tfaccum.counts import with_counter_properties
from tfaccum.fit_scope import FitScope
from tfaccum.moments import BatchNormWindows
from tfaccum.moments import accumulating_layers
from tfaccum.moments import window_observers
from tfaccum.noise_scale import NoiseScaleEstimator
from tfaccum.schedule import AccumulationSchedule
from tfaccum.summary import AccumulationSummaries
from tfaccum.window_loss import window_loss_of

_PAST = {"flush": "flushed", "carry": "carried", "drop": "dropped"}
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

    At the start of `fit` the callback installs an accumulating step on the
    model (see `AccumulationHook`): the gradients of `accumulation_steps`
    consecutive micro-batches are summed and the optimizer updates once with
    their normalised sum. `optimizer.iterations`, and with it every
    learning-rate schedule, counts those updates. Metrics and the progress bar
    still update every micro-batch. When `fit` ends the hook is removed and the
    model is a plain Keras model again.

    A model compiled with a `tfaccum.WindowLoss` (a loss with in-batch
    negatives: `InBatchSoftmax`, `NTXent`) gets its loss computed over the
    whole window, by gradient caching (`tfaccum.gradient_cache`): still
    exactly the large batch.

    Args:
        accumulation_steps: Micro-batches per optimizer update. An integer
            >= 1; a dict `{epoch: steps}` whose value applies from that epoch
            (0-based) on, with 1 before its smallest key, e.g. `{0: 8, 5: 4}`;
            or a callable `epoch -> steps`, evaluated at each epoch's start.
        reduction: How a window's gradients are combined. `"auto"` weights
            each micro-batch by what its loss is an average over and divides
            by the window's total, so a window is exactly one large batch,
            even when it ends with a smaller micro-batch: its samples, or,
            where a Keras mask (`Embedding(mask_zero=True)`, `Masking`, ...)
            or `ignore_class=` reaches the loss, its unmasked elements
            (tokens). A custom loss or step says it with
            `tfaccum.count_items()`. `"samples"` always weights by samples
            (exact for losses averaged per sample); `"mean"` weights
            micro-batches equally (Keras' built-in behaviour); `"sum"` adds
            them without dividing (for losses reduced with `"sum"`). A
            `tfaccum.Reduction` instance is a weighting of your own.
            Defaults to `"auto"`.
        leftover: What happens to a window that is not full when an epoch
            ends. `"flush"` applies it, normalised by what it holds, before
            validation runs. `"carry"` keeps it for the next epoch and applies
            what remains when `fit` ends. `"drop"` discards it and counts its
            micro-batches in `dropped_micro_steps`. Defaults to `"flush"`.
        verbose: `0` is silent; `1` prints, after each epoch, the micro-steps,
            updates and leftover window of that epoch. Defaults to `0`.
        skip_nonfinite: Leave a micro-batch whose gradient holds a NaN or an
            infinity out of its window, counted in `nonfinite_skips`, instead
            of letting it spoil the whole window; under mixed precision the
            loss scale is halved too, as Keras does. With several replicas a
            replica leaves out its own share of the micro-batch (counted
            in `nonfinite_skips`), and the loss scale is halved once at the
            window's end, alike on every replica. Defaults to `None`: on
            under mixed precision (`LossScaleOptimizer`), where overflow is
            expected, off in float32, where it usually means divergence.
        noise_scale: Estimate the gradient noise scale B_simple (McCandlish et
            al. 2018), the batch size beyond which more accumulation stops
            paying, from the micro-batch and window gradients it already has;
            read it as `callback.noise_scale` and
            `callback.suggested_accumulation_steps`. With several replicas
            the small batches are the first replica's shares. Defaults to
            `None`: on whenever `accumulation_steps` > 1 (windows of one
            micro-batch give no estimate), except with a window-wide loss
            (a micro-batch has no gradient of its own there); `True` insists, and is an error
            with `accumulation_steps=1`; `False` turns it off.
        log_dir: Directory for TensorBoard summaries of every optimizer
            update and leftover event, shown in the "Accumulation" tab
            (`tensorboard --logdir <parent>`). With several replicas the
            series are the global window's (written by the chief worker
            only; other workers write nothing) and the micro-batch norms
            those of the first replica's shares. Defaults to `None` (no
            summaries).
        scalars: With `log_dir`, also write the applied gradient norm as a
            plain scalar (`accumulation/gradient_norm`) for the Scalars and
            Time Series tabs. Defaults to `False`: the Accumulation tab
            already shows it, and those tabs stay for your own metrics.
        write_interval: With `log_dir`, seconds after which the summaries
            recorded so far are written to disk even within an epoch, so a
            killed process loses at most about that much. Checked on the
            host after each batch, without reading the device. Defaults to
            `30`.
        sparse_gradients: `"rows"`: a sparse gradient (an embedding's
            `IndexedSlices`) reaches the optimizer as the window's rows in one
            `IndexedSlices`, as the large batch's would, so every optimizer
            (Adam and Adagrad treat rows one by one) updates as for the large
            batch; memory: the window's looked-up rows. `"dense"`: summed
            into a dense accumulator and applied densely; memory: the whole
            variable. Defaults to `"rows"` (`"dense"`, with a warning, under
            `jit_compile=True` and with several replicas).
        accumulator_dtype: `"float32"` (the default; float64 variables keep
            float64 accumulators) or `"bfloat16"`: the
            dense accumulators hold half as much, and the peak is lower under
            a pooling allocator (a GPU's, or the CPU's with
            `TF_CPU_ALLOCATOR_USE_BFC=true`) but higher than float32's on the
            CPU's default allocator (README, "Memory"); each micro-step is
            summed in float32 and rounded stochastically, so the window's sum
            is the float32 sum on average (README: "Reduced-precision
            accumulators" says how far it strays). Sparse rows stay float32.
            Refused under a strategy with several replicas.

    Attributes:
        counters: The last `fit`'s counters in one `tfaccum.counts.Counters`
            snapshot (`micro_steps`, `optimizer_steps`, `flushes`,
            `dropped_micro_steps`, `nonfinite_skips`, `samples`, `items`),
            each also a property of its own.

    Example:

    ```python
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=8, epochs=3,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    # trained like batch_size=32
    ```
    """

    def __init__(
        self,
        *,
        accumulation_steps=None,
        reduction="auto",
        leftover="flush",
        verbose=0,
        skip_nonfinite=None,
        noise_scale=None,
        log_dir=None,
        scalars=False,
        write_interval=30.0,
        sparse_gradients="rows",
        accumulator_dtype="float32",
        **kwargs,
    ):
        checks.reject_unknown(kwargs, list(_OPTIONS))
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
        self.estimator = None  # a NoiseScaleEstimator once fit starts
        self.log_dir = checks.check_log_dir(log_dir)
        self.scalars = checks.check_scalars(scalars, log_dir)
        self.write_interval = checks.check_write_interval(write_interval)
        self.sparse_gradients = checks.check_sparse_gradients(sparse_gradients)
        self.accumulator_dtype = checks.check_accumulator_dtype(accumulator_dtype)
        self.summaries = None  # created at the first fit with a log_dir
        self._scope = FitScope(end_fit=self._end_fit)
        self._epoch_open = False

    # -- counters -------------------------------------------------------------

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
        if self.estimator is None:
            return None
        return self.estimator.suggested_accumulation_steps()

    def get_config(self):
        return {name: getattr(self, attribute) for name, attribute in _OPTIONS.items()}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"GradientAccumulationCallback({args})"

    # -- fit lifecycle ----------------------------------------------------------

    def on_train_begin(self, logs=None):
        model = self.model
        self._first_among_callbacks()
        if self.log_dir is not None and _keras.writes_summaries(model.distribute_strategy):
            checks.probe_log_dir(self.log_dir)
        configuration = self._configuration(model)
        hook = self._scope.reusable(model, configuration)
        if hook is not None:  # same model, same compile: no re-tracing
            if hook is not self.hook:
                self._adopt_observers(hook)
            self._scope.begin(hook, reinstall=True)
        else:
            self._scope.begin(self._new_hook(model, configuration), reinstall=False)
        self._epoch_open = False
        self._last_batch = -1
        if self.summaries is not None:
            self._summary_headroom = self.summaries.capacity - (
                _keras.api_for(model).steps_per_execution(model))

    def _first_among_callbacks(self):
        """Refuses checkpoints that cannot resume accumulation; runs first.

        Moves this callback to the front of the fit's callbacks, so that a
        window ends before any other callback's epoch-end work (a checkpoint
        or a backup) sees the weights, also where the epoch's length is
        unknown and the window can only end in `on_epoch_end`.
        """
        callbacks = _keras.fit_callback_list(self)
        if callbacks is None:
            return
        orbax = _keras.orbax_checkpoint_class()
        for other in callbacks.callbacks:
            if (orbax is not None and isinstance(other, orbax)
                    and not isinstance(other.save_freq, str) and not self.schedule.always_one):
                raise ValueError(
                    "OrbaxCheckpoint with an integer `save_freq` cannot resume gradient "
                    "accumulation: it counts batches from `optimizer.iterations`, which "
                    "counts optimizer updates (one per window), so a resumed `fit` saves "
                    "steps that already exist (StepAlreadyExistsError; Keras' own "
                    "`gradient_accumulation_steps` fails alike). Use "
                    "OrbaxCheckpoint(save_freq='epoch') (with `initial_epoch` when "
                    "resuming) or keras.callbacks.ModelCheckpoint. Received: "
                    f"OrbaxCheckpoint(save_freq={other.save_freq!r}) with "
                    f"accumulation_steps={self.accumulation_steps!r}"
                )
        if callbacks.callbacks[0] is not self:
            callbacks.callbacks.remove(self)
            callbacks.callbacks.insert(0, self)

    def _configuration(self, model):
        """The `Configuration` of the hook this callback makes for `model`: it builds
        the hook, and a traced hook of an equal one is reused."""
        observers = []
        if self._wants_noise_scale(model):
            observers.append(NoiseScaleEstimator)
        if self.log_dir is not None and _keras.writes_summaries(model.distribute_strategy):
            observers.append(AccumulationSummaries)
        if accumulating_layers(model):
            observers.append(BatchNormWindows)
        return Configuration.resolve(
            reduction=self.reduction, skip_nonfinite=self.skip_nonfinite,
            sparse_gradients=self.sparse_gradients, accumulator_dtype=self.accumulator_dtype,
            observers=observers)

    def _wants_noise_scale(self, model):
        if self.noise_scale_option is not None:
            return self.noise_scale_option
        # A window-wide loss has no micro-batch gradient to compare.
        return not self.schedule.always_one and window_loss_of(model) is None

    def _adopt_observers(self, hook):
        """Takes over the summaries and estimator of another callback's hook."""
        self.summaries = self.estimator = None
        for observer in hook.observers:
            if isinstance(observer, AccumulationSummaries):
                self.summaries = observer
                observer.log_dir = self.log_dir
                observer.scalars = self.scalars
                observer.write_interval = self.write_interval
            elif isinstance(observer, NoiseScaleEstimator):
                self.estimator = observer
                observer.restart()

    def _new_hook(self, model, configuration):
        strategy = model.distribute_strategy
        wanted = configuration.observers
        self.estimator = NoiseScaleEstimator() if NoiseScaleEstimator in wanted else None
        self.summaries = None
        # Across workers the chief writes: every worker's rows are the same.
        if AccumulationSummaries in wanted:
            self.summaries = AccumulationSummaries(
                self.log_dir,
                scalars=self.scalars,
                write_interval=self.write_interval,
                noise=self.estimator,
            )
        observers = [o for o in (self.estimator, self.summaries) if o is not None]
        observers += window_observers(model, strategy)
        # Windows of 1 until each epoch's start sets the schedule's.
        return AccumulationHook.made_with(model, configuration, observers, accumulation_steps=1)

    def on_epoch_begin(self, epoch, logs=None):
        try:
            steps = self.schedule(epoch)
            if steps == 1 and self.noise_scale_option:
                raise ValueError(
                    "The noise scale compares gradients at two batch sizes: "
                    "it needs `accumulation_steps` >= 2. Received: "
                    f"noise_scale=True with accumulation_steps({epoch}) = 1 "
                    "at the start of that epoch. Pass noise_scale=False."
                )
        except (TypeError, ValueError):
            self._abandon()
            raise
        self.hook.set_accumulation_steps(steps)
        self._last_batch = -1
        if self.verbose:
            self._epoch_start = self.hook.counts.numpy()
        self._epoch_open = True

    def on_train_batch_end(self, batch, logs=None):
        if self.summaries is not None:
            # Write before the device buffer can fill (an update per
            # micro-step at most), or when it is time to; counted here, never
            # read from the device.
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
            epoch_count = {name: now[name] - self._epoch_start[name] for name in now}
            items = ""
            if epoch_count["items"] != epoch_count["samples"]:
                items = f" ({epoch_count['items']} items)"
            _keras.print_msg(
                f"Epoch {epoch + 1}: "
                f"{_counted(epoch_count['micro_steps'], 'micro-step')}{items}, "
                f"{_counted(epoch_count['optimizer_steps'], 'optimizer update')} "
                f"(accumulation_steps={self.hook.accumulation_steps}); "
                f"{self._describe_leftover(self._leftover_window)}"
                f"{self._describe_noise_scale()}."
            )

    def on_train_end(self, logs=None):
        if self.hook is None or not self.hook.installed:
            return
        if not self._scope.fit_ended:
            self._end_fit()
        self._scope.retire()

    def _end_fit(self):
        """Applies or drops what is left when `fit` ends; the loop is over."""
        hook = self.hook
        self._scope.end()
        window = hook.drop() if self.leftover == "drop" else hook.flush()
        action = "drop" if self.leftover == "drop" else "flush"
        self._log_leftover(action, window)
        if self.summaries is not None:
            self.summaries.flush()
        if self.verbose and window.micro_batches:
            _keras.print_msg(
                f"GradientAccumulationCallback: {_PAST[action]} "
                f"{self._describe(window)} when fit ended."
            )

    # -- helpers ----------------------------------------------------------------

    def _end_epoch(self):
        self._epoch_open = False
        if self.leftover == "flush":
            self._leftover_window = self.hook.flush()
        elif self.leftover == "drop":
            self._leftover_window = self.hook.drop()
        else:
            self._leftover_window = self.hook.pending
        self._log_leftover(self.leftover, self._leftover_window)

    def _log_leftover(self, policy, window):
        if self.summaries is not None and window.micro_batches:
            self.summaries.write_leftover(
                int(_keras.iterations(self.model.optimizer).numpy()),
                policy,
                window,
                micro_steps=self.hook.micro_steps,
                updates=self.hook.optimizer_steps,
                nonfinite=self.hook.nonfinite_skips,
            )

    def _describe_noise_scale(self):
        noise_scale = self.noise_scale
        if noise_scale is None:
            return ""
        return (
            f"; noise scale B_simple={noise_scale:.4g} (suggests "
            f"accumulation_steps={self.suggested_accumulation_steps})"
        )

    def _describe_leftover(self, window):
        if not window.micro_batches:
            return "no partial window"
        return f"{_PAST[self.leftover]} {self._describe(window)}"

    @staticmethod
    def _describe(window):
        return (
            f"a partial window of {_counted(window.micro_batches, 'micro-batch')} "
            f"({_counted(window.samples, 'sample')})"
        )

    def _abandon(self):
        """Removes the hook after an error that aborts `fit`."""
        self._scope.abandon()


def _counted(count, noun):
    """`1 micro-step`, `2 micro-steps`."""
    plural = "es" if noun.endswith("ch") else "s"
    return f"{count} {noun}{'' if count == 1 else plural}"
