"""`GradientAccumulationCallback`: exact large-batch training with `model.fit`."""

import difflib
import os
import warnings

from tfaccum import _keras
from tfaccum.hook import AccumulationHook
from tfaccum.hook import check_reduction
from tfaccum.noise_scale import NoiseScaleEstimator
from tfaccum.schedule import AccumulationSchedule
from tfaccum.summary import AccumulationSummaries

LEFTOVERS = ("flush", "carry", "drop")
_PAST = {"flush": "flushed", "carry": "carried", "drop": "dropped"}


def _check_leftover(leftover):
    if leftover not in LEFTOVERS:
        raise ValueError(
            f"`leftover` must be one of {', '.join(map(repr, LEFTOVERS))}. "
            f"Received: leftover={leftover!r}"
        )
    return leftover


def _reject_unknown(kwargs, known):
    if not kwargs:
        return
    hints = []
    for name in kwargs:
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            hints.append(f"`{name}` (did you mean `{close[0]}`?)")
        else:
            hints.append(f"`{name}`")
    raise TypeError(
        "Unrecognized keyword arguments passed to "
        f"GradientAccumulationCallback: {', '.join(hints)}. Accepted: "
        f"{', '.join(known)}. Received: {kwargs!r}"
    )


class GradientAccumulationCallback(_keras.Callback):
    """Trains with micro-batches as if the batch were `accumulation_steps` times larger.

    At the start of `fit` the callback installs an accumulating step on the
    model (see `AccumulationHook`): the gradients of `accumulation_steps`
    consecutive micro-batches are summed and the optimizer updates once with
    their normalised sum. `optimizer.iterations`, and with it every
    learning-rate schedule, counts those updates. Metrics and the progress bar
    still update every micro-batch. When `fit` ends the hook is removed and the
    model is a plain Keras model again.

    Args:
        accumulation_steps: Micro-batches per optimizer update. An integer
            >= 1; a dict `{epoch: steps}` whose value applies from that epoch
            (0-based) on, with 1 before its smallest key, e.g. `{0: 8, 5: 4}`;
            or a callable `epoch -> steps`, evaluated at each epoch's start.
        reduction: How a window's gradients are combined. `"samples"` weights
            each micro-batch by its number of samples, so a window is exactly
            one large batch even when it ends with a smaller micro-batch.
            `"mean"` weights micro-batches equally (Keras' built-in behaviour);
            `"sum"` adds them without dividing (for losses reduced with
            `"sum"`). Defaults to `"samples"`.
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
            loss scale is halved too, as Keras does. Defaults to `None`: on
            under mixed precision (`LossScaleOptimizer`), where overflow is
            expected, off in float32, where it usually means divergence.
        noise_scale: Estimate the gradient noise scale B_simple (McCandlish et
            al. 2018), the batch size beyond which more accumulation stops
            paying, from the micro-batch and window gradients it already has;
            read it as `callback.noise_scale` and
            `callback.suggested_accumulation_steps`. Defaults to `None`: on
            with one replica (windows of one micro-batch give no estimate);
            `True` insists, and is an error where it cannot be estimated
            (`accumulation_steps=1`, several replicas); `False` turns it off.
        log_dir: Directory for TensorBoard summaries of every optimizer
            update and leftover event, shown in the "Accumulation" tab
            (`tensorboard --logdir <parent>`). Defaults to `None` (no
            summaries).
        scalars: With `log_dir`, also write the applied gradient norm as a
            plain scalar (`accumulation/gradient_norm`) for the Scalars and
            Time Series tabs. Defaults to `False`: the Accumulation tab
            already shows it, and those tabs stay for your own metrics.

    Attributes (integers counted over the last `fit`):
        micro_steps: Micro-batches trained on.
        optimizer_steps: Optimizer updates made.
        flushes: Partial windows applied at epoch or `fit` end.
        dropped_micro_steps: Micro-batches discarded by `leftover="drop"`.
        nonfinite_skips: Micro-batches left out for non-finite gradients.

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
        reduction="samples",
        leftover="flush",
        verbose=0,
        skip_nonfinite=None,
        noise_scale=None,
        log_dir=None,
        scalars=False,
        **kwargs,
    ):
        _reject_unknown(
            kwargs,
            [
                "accumulation_steps",
                "reduction",
                "leftover",
                "verbose",
                "skip_nonfinite",
                "noise_scale",
                "log_dir",
                "scalars",
            ],
        )
        super().__init__()
        self.schedule = AccumulationSchedule(accumulation_steps)
        self.accumulation_steps = accumulation_steps
        self.reduction = check_reduction(reduction)
        self.leftover = _check_leftover(leftover)
        if verbose not in (0, 1) or isinstance(verbose, float):
            raise ValueError(
                f"`verbose` must be 0 or 1. Received: verbose={verbose!r}"
            )
        self.verbose = int(verbose)
        if skip_nonfinite is not None and not isinstance(skip_nonfinite, bool):
            raise TypeError(
                "`skip_nonfinite` must be None, True or False. "
                f"Received: skip_nonfinite={skip_nonfinite!r}"
            )
        self.skip_nonfinite = skip_nonfinite
        if noise_scale is not None and not isinstance(noise_scale, bool):
            raise TypeError(
                "`noise_scale` must be None, True or False. "
                f"Received: noise_scale={noise_scale!r}"
            )
        if noise_scale is True and accumulation_steps == 1 and self.schedule.is_constant:
            raise ValueError(
                "The noise scale compares gradients at two batch sizes, the "
                "micro-batch and the window: it needs `accumulation_steps` >= 2. "
                "Received: noise_scale=True with accumulation_steps=1. Pass "
                "noise_scale=False, or accumulate."
            )
        self.noise_scale_option = noise_scale
        self.estimator = None  # a NoiseScaleEstimator once fit starts
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(
                "`log_dir` must be a path (str or os.PathLike) or None. "
                f"Received: log_dir={log_dir!r}"
            )
        if not isinstance(scalars, bool):
            raise TypeError(
                f"`scalars` must be True or False. Received: scalars={scalars!r}"
            )
        if scalars and log_dir is None:
            raise ValueError(
                "`scalars=True` writes to `log_dir`: pass a `log_dir` too. "
                "Received: log_dir=None"
            )
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.scalars = scalars
        self.summaries = None  # created at the first fit with a log_dir
        self.hook = None  # kept after `fit` for its counters and compiled step
        self._epoch_open = False

    # -- counters -------------------------------------------------------------

    def _count(self, name):
        return 0 if self.hook is None else getattr(self.hook, name)

    @property
    def micro_steps(self):
        return self._count("micro_steps")

    @property
    def optimizer_steps(self):
        return self._count("optimizer_steps")

    @property
    def flushes(self):
        return self._count("flushes")

    @property
    def dropped_micro_steps(self):
        return self._count("dropped_micro_steps")

    @property
    def nonfinite_skips(self):
        return self._count("nonfinite_skips")

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
        return {
            "accumulation_steps": self.accumulation_steps,
            "reduction": self.reduction,
            "leftover": self.leftover,
            "verbose": self.verbose,
            "skip_nonfinite": self.skip_nonfinite,
            "noise_scale": self.noise_scale_option,
            "log_dir": self.log_dir,
            "scalars": self.scalars,
        }

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"GradientAccumulationCallback({args})"

    # -- fit lifecycle ----------------------------------------------------------

    def on_train_begin(self, logs=None):
        stale = AccumulationHook.installed_on(self.model)
        if stale is not None:
            window = stale.drop()
            stale.remove()
            warnings.warn(
                "Removed the accumulation hook left on model "
                f"{self.model.name!r} by an earlier `fit` that did not finish; "
                f"discarded its {window.micro_batches} pending micro-batches "
                f"({window.samples} samples).",
                stacklevel=2,
            )
        hook = self.hook
        if hook is not None and hook.model is self.model and hook.can_reinstall():
            hook.reinstall()  # same model, same compile: no re-tracing
        else:
            if self.log_dir is not None:
                self.summaries = AccumulationSummaries(
                    self.log_dir, scalars=self.scalars
                )
            strategy = self.model.distribute_strategy
            self.estimator = None
            if self.noise_scale_option or (
                self.noise_scale_option is None
                and strategy.num_replicas_in_sync == 1
            ):
                self.estimator = NoiseScaleEstimator(strategy)
            self.hook = AccumulationHook(
                self.model,
                accumulation_steps=1,  # set from the schedule at each epoch start
                reduction=self.reduction,
                skip_nonfinite=self.skip_nonfinite,
                summaries=self.summaries,
                noise=self.estimator,
            )
        self._epoch_open = False
        self._unwritten_micro_steps = 0
        if self.summaries is not None:
            self._summary_headroom = self.summaries.capacity - (
                self.hook._api.steps_per_execution(self.model)
            )

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
            self._epoch_start = (self.hook.micro_steps, self.hook.optimizer_steps)
        self._epoch_open = True

    def on_train_batch_end(self, batch, logs=None):
        if self.summaries is not None:
            # Write before the device buffer can fill (an update per
            # micro-step at most); counted here, never read from the device.
            self._unwritten_micro_steps += batch - self._last_batch
            self._last_batch = batch
            if self._unwritten_micro_steps >= self._summary_headroom:
                self.summaries.write()
                self._unwritten_micro_steps = 0
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
            self._unwritten_micro_steps = 0
        if self.verbose:
            micro_start, updates_start = self._epoch_start
            _keras.print_msg(
                f"Epoch {epoch + 1}: "
                f"{self.hook.micro_steps - micro_start} micro-steps, "
                f"{self.hook.optimizer_steps - updates_start} optimizer updates "
                f"(accumulation_steps={self.hook.accumulation_steps}); "
                f"{self._describe_leftover(self._leftover_window)}"
                f"{self._describe_noise_scale()}."
            )

    def on_train_end(self, logs=None):
        if self.hook is None or not self.hook.installed:
            return
        window = (
            self.hook.drop() if self.leftover == "drop" else self.hook.flush()
        )
        action = "drop" if self.leftover == "drop" else "flush"
        self._log_leftover(action, window)
        if self.summaries is not None:
            self.summaries.flush()
        if self.verbose and window.micro_batches:
            _keras.print_msg(
                f"GradientAccumulationCallback: {_PAST[action]} "
                f"{self._describe(window)} when fit ended."
            )
        self.hook.remove()

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
                int(self.model.optimizer.iterations),
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
            f"a partial window of {window.micro_batches} micro-batches "
            f"({window.samples} samples)"
        )

    def _abandon(self):
        """Removes the hook after an error that aborts `fit`."""
        if self.hook is not None and self.hook.installed:
            self.hook.drop()
            self.hook.remove()
