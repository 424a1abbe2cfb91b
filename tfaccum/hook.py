"""The accumulating train step, installed on and removed from a compiled model.

`GradientAccumulationCallback` uses this for `fit`; it is public for loops
that drive the model themselves (`train_on_batch`, or `fit` without the
callback's epoch bookkeeping).
"""

import collections
import contextlib
import dataclasses
import threading
import warnings

import tensorflow as tf

from tfaccum import _keras
from tfaccum.layers import accumulating_layers
from tfaccum.norms import squared_norm
from tfaccum.norms import unscaled

REDUCTIONS = ("samples", "mean", "sum")

Window = collections.namedtuple("Window", ["micro_batches", "samples"])
Window.__doc__ = """What an accumulation window held: micro-batches and samples."""

_HOOK_ATTRIBUTE = "_tfaccum_hook"

# The layout of `AccumulationHook._counts`.
_COUNTS = (
    "window_micro_steps",
    "window_samples",
    "window_nonfinite",
    "micro_steps",
    "optimizer_steps",
    "flushes",
    "dropped_micro_steps",
    "nonfinite_skips",
)
_WINDOW_MICRO, _WINDOW_SAMPLES, _WINDOW_NONFINITE = 0, 1, 2
_WINDOW = 3  # the first three counts describe the open window
# What one micro-step adds: _MICRO_STEP + samples * _SAMPLE, or
# _MICRO_STEP + _NONFINITE when its gradient is left out.
_MICRO_STEP = (1, 0, 0, 1, 0, 0, 0, 0)
_SAMPLE = (0, 1, 0, 0, 0, 0, 0, 0)
_NONFINITE = (0, 0, 1, 0, 0, 0, 0, 1)


def _count_delta(**deltas):
    """An int64 vector adding `deltas` to the named counts."""
    return tf.stack(
        [tf.cast(deltas.get(name, 0), tf.int64) for name in _COUNTS]
    )


def check_reduction(reduction):
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"`reduction` must be one of {', '.join(map(repr, REDUCTIONS))}. "
            f"Received: reduction={reduction!r}"
        )
    return reduction


@dataclasses.dataclass
class _Step:
    """One micro-step being traced: its sample count and the calls it made."""

    samples: object
    applies: list = dataclasses.field(default_factory=list)
    scales: list = dataclasses.field(default_factory=list)


def _count_samples(data):
    """Number of samples in a micro-batch, as an int64 scalar tensor."""
    x, _, _ = _keras.unpack_x_y_sample_weight(data)
    for leaf in tf.nest.flatten(x):
        if leaf is None:
            continue
        if isinstance(leaf, tf.SparseTensor):
            return tf.cast(leaf.dense_shape[0], tf.int64)
        if isinstance(leaf, tf.RaggedTensor):
            return tf.cast(leaf.nrows(), tf.int64)
        return tf.shape(leaf, out_type=tf.int64)[0]
    raise ValueError(
        "Cannot count the samples of a micro-batch: its inputs `x` hold no "
        f"tensor. Received: x={x!r}"
    )


def _accumulator_dtype(variable):
    dtype = tf.as_dtype(variable.dtype)
    return tf.float64 if dtype == tf.float64 else tf.float32


class AccumulationHook:
    """Makes a compiled model update its weights once per window of micro-batches.

    Creating the hook installs it: the model's `train_step` gets wrapped so
    that the gradients its optimizer receives are summed into accumulators,
    and the optimizer is called once every `accumulation_steps` micro-batches
    with their normalised sum. `remove()` restores the plain model. The model's
    `train_step` (Keras' default, or an override) must apply its gradients
    through `self.optimizer.apply_gradients()` or `self.optimizer.apply()`,
    exactly once per step.

    A window that is not full is kept until `flush()` (apply it now,
    normalised by what it holds) or `drop()` (discard it). All per-step work
    runs inside the model's compiled train function; counters are read from
    the device only when you ask for them.

    Args:
        model: A compiled Keras model.
        accumulation_steps: Integer >= 1, micro-batches per optimizer update.
            Change it between steps with `set_accumulation_steps()`.
        reduction: How the window's gradients are combined. `"samples"`
            weights each micro-batch by its number of samples, so a window is
            exactly one large batch even when its last micro-batch is short.
            `"mean"` gives each micro-batch equal weight (Keras' own
            accumulation), `"sum"` adds them without dividing. Defaults to
            `"samples"`.
        skip_nonfinite: Leave a micro-batch whose gradient holds a NaN or an
            infinity out of its window (counted in `nonfinite_skips`) instead
            of letting it spoil the window. Under mixed precision
            (`LossScaleOptimizer`) the loss scale is also halved, as Keras
            does. `None` (the default) turns it on exactly under
            `LossScaleOptimizer`, where overflow is expected; in float32 a
            non-finite gradient usually means divergence, which should show.
        summaries: An `AccumulationSummaries` that records every update.
        noise: A `NoiseScaleEstimator` fed every micro-step and update.

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

    def __init__(
        self,
        model,
        *,
        accumulation_steps,
        reduction="samples",
        skip_nonfinite=None,
        summaries=None,
        noise=None,
    ):
        self._api = api = _keras.api_for(model)
        if not api.is_compiled(model):
            raise ValueError(
                "The model must be compiled before gradient accumulation can "
                "be installed on it: call `model.compile(optimizer=..., "
                f"loss=...)` first. Received: model={model.name!r} with "
                f"optimizer={getattr(model, 'optimizer', None)!r}"
            )
        optimizer = model.optimizer
        built_in = api.built_in_accumulation_steps(optimizer)
        if built_in:
            raise ValueError(
                "The model's optimizer already accumulates gradients itself "
                f"(gradient_accumulation_steps={built_in}); accumulating "
                "again would multiply the window. Compile the model with an "
                "optimizer without `gradient_accumulation_steps` and let "
                "tfaccum accumulate. Received: "
                f"{type(optimizer).__name__}(gradient_accumulation_steps="
                f"{built_in})"
            )
        existing = AccumulationHook.installed_on(model)
        if existing is not None:
            raise ValueError(
                f"Model {model.name!r} already has an accumulation hook "
                f"installed ({existing!r}). Remove it first with "
                "`hook.remove()` or `tfaccum.remove_accumulation_hook(model)`."
            )
        self.model = model
        self.reduction = check_reduction(reduction)
        if skip_nonfinite is not None and not isinstance(skip_nonfinite, bool):
            raise TypeError(
                "`skip_nonfinite` must be None, True or False. "
                f"Received: skip_nonfinite={skip_nonfinite!r}"
            )
        if skip_nonfinite is None:
            skip_nonfinite = _keras.scales_loss_dynamically(optimizer)
        self._strategy = model.distribute_strategy
        self._replicas = self._strategy.num_replicas_in_sync
        if self._replicas > 1:
            unsupported = [
                name
                for name, used in (
                    ("skip_nonfinite (and mixed precision)", skip_nonfinite),
                    ("summaries (log_dir)", summaries is not None),
                    ("the noise scale", noise is not None),
                )
                if used
            ]
            if unsupported:
                raise ValueError(
                    f"{' and '.join(unsupported)} with several replicas is not "
                    f"supported yet. Received: model {model.name!r} under "
                    f"{type(self._strategy).__name__} with {self._replicas} "
                    "replicas. Accumulate on one device for those, or leave "
                    "them off."
                )
        self.skip_nonfinite = skip_nonfinite
        self.summaries = summaries
        self.noise = noise
        self._optimizer = optimizer
        self._accumulators = {}  # id(variable) -> accumulator variable
        self._local = threading.local()  # the `_Step` being traced, per thread
        self._patch_lock = threading.Lock()
        self._patch_depth = 0
        self._applied = None  # (variables, has_gradient) seen when tracing
        self._train_function = None
        self._flush_function = None
        self._drop_function = None
        with tf.init_scope(), self._strategy.scope():
            self._steps = tf.Variable(
                tf.ones((), tf.int64), trainable=False, name="accumulation_steps"
            )
            # One vector, so that a micro-step updates all it counts at once.
            # With several replicas each keeps its own, read as their sum:
            # samples from every replica, the other counts from the first.
            self._counts = tf.Variable(
                tf.zeros((len(_COUNTS),), tf.int64),
                trainable=False,
                name="counts",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM,
            )
            # With several replicas: micro-steps into the open window, kept
            # by every replica, so that each decides when the window is full
            # without talking to the others (over a network, per micro-step).
            self._window_position = tf.Variable(
                tf.zeros((), tf.int64),
                trainable=False,
                name="window_position",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            if model.built:
                for variable in model.trainable_variables:
                    self._accumulator(variable)
        # AccumBatchNormalization layers pool their statistics per window.
        self._windowed_layers = [
            (layer, layer._new_window(self._strategy))
            for layer in accumulating_layers(model)
        ]
        self.set_accumulation_steps(accumulation_steps)
        self.installed = False
        self._install()

    # -- installation ---------------------------------------------------

    @staticmethod
    def installed_on(model):
        """The hook installed on `model`, or `None`."""
        return model.__dict__.get(_HOOK_ATTRIBUTE)

    def _compiled_state(self):
        """What the compiled train function depends on, besides this hook."""
        model = self.model
        return (
            model.optimizer,
            getattr(model, "_compile_config", None),
            self._api.steps_per_execution(model),
            model.jit_compile,
            model.run_eagerly,
            tuple(id(v) for v in model.trainable_variables),
        )

    def _install(self):
        model = self.model
        self._had_own_train_step = "train_step" in model.__dict__
        self._original_train_step = model.train_step
        object.__setattr__(model, "train_step", self._train_step)
        object.__setattr__(model, _HOOK_ATTRIBUTE, self)
        for layer, window in self._windowed_layers:
            layer._set_window(window)
        if self._train_function is None:
            model.make_train_function(force=True)
            self._train_function = model.train_function
            self._compiled_for = self._compiled_state()
        else:
            model.train_function = self._train_function
        self.installed = True

    def can_reinstall(self):
        """Whether `reinstall()` can reuse this hook's compiled step.

        True unless the hook is installed, the model was compiled again, or
        its trainable variables or execution settings changed since.
        """
        if self.installed or AccumulationHook.installed_on(self.model):
            return False
        current = self._compiled_state()
        return all(a is b or a == b for a, b in zip(current, self._compiled_for))

    def reinstall(self):
        """Installs this hook again with zeroed counters, reusing its traced step.

        Saves re-tracing the train function when the same model is fitted
        again (for example `fit` called once per epoch).
        """
        if not self.can_reinstall():
            raise ValueError(
                "This hook cannot be reinstalled: it is installed, or the "
                f"model {self.model.name!r} was recompiled or changed since. "
                "Create a new one with `tfaccum.install_accumulation_hook()`."
            )
        for accumulator in self._accumulators.values():
            accumulator.assign(tf.zeros_like(accumulator))
        for _, pooled in self._windowed_layers:
            pooled.reset()
        self._counts.assign(tf.zeros_like(self._counts))
        self._window_position.assign(0)
        if self.summaries is not None:
            self.summaries.on_window_reset()
        self._install()

    def remove(self):
        """Restores the plain model. Warns if a window was left pending."""
        if not self.installed:
            return
        pending = self.pending
        if pending.micro_batches:
            warnings.warn(
                f"Removing the accumulation hook discards {pending.micro_batches} "
                f"micro-batches ({pending.samples} samples) that were never "
                "applied. Call `hook.flush()` (or `hook.drop()`) before "
                "`hook.remove()` to decide what happens to them.",
                stacklevel=2,
            )
        self._uninstall()

    def _uninstall(self):
        model = self.model
        object.__delattr__(model, "train_step")
        if self._had_own_train_step:
            object.__setattr__(model, "train_step", self._original_train_step)
        object.__delattr__(model, _HOOK_ATTRIBUTE)
        for layer, _ in self._windowed_layers:
            layer._set_window(None)
        # The next `fit` (or `train_on_batch`) builds a plain train function.
        model.train_function = None
        self.installed = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if exc_type is None:
            self.flush()
        else:
            self.drop()
        self.remove()
        return False

    # -- configuration ----------------------------------------------------

    @property
    def accumulation_steps(self):
        return int(self._steps.numpy())

    def set_accumulation_steps(self, accumulation_steps):
        """Sets the window length used from the next micro-batch on."""
        from tfaccum.schedule import check_steps

        self._steps.assign(check_steps(accumulation_steps))

    # -- counters -----------------------------------------------------------

    def _read(self, name):
        return int(self._counts[_COUNTS.index(name)].numpy())

    @property
    def micro_steps(self):
        """Micro-batches accumulated since the hook was installed."""
        return self._read("micro_steps")

    @property
    def optimizer_steps(self):
        """Optimizer updates made since the hook was installed."""
        return self._read("optimizer_steps")

    @property
    def flushes(self):
        """Partial windows applied by `flush()`."""
        return self._read("flushes")

    @property
    def dropped_micro_steps(self):
        """Micro-batches discarded by `drop()`."""
        return self._read("dropped_micro_steps")

    @property
    def nonfinite_skips(self):
        """Micro-batches left out of their window for non-finite gradients."""
        return self._read("nonfinite_skips")

    @property
    def pending(self):
        """The `Window` accumulated but not yet applied."""
        counts = self._counts.numpy()
        return Window(int(counts[_WINDOW_MICRO]), int(counts[_WINDOW_SAMPLES]))

    def __repr__(self):
        return (
            f"AccumulationHook(model={self.model.name!r}, "
            f"accumulation_steps={self.accumulation_steps}, "
            f"reduction={self.reduction!r}, installed={self.installed}, "
            f"micro_steps={self.micro_steps}, "
            f"optimizer_steps={self.optimizer_steps})"
        )

    # -- the per-step graph ---------------------------------------------------

    def _train_step(self, data):
        step = _Step(samples=_count_samples(data))
        # MirroredStrategy traces the step of each replica in its own thread.
        self._local.step = step
        with self._patched_optimizer():
            logs = self._original_train_step(data)
        applies, scales = step.applies, step.scales
        if len(applies) != 1 or len(scales) > 1:
            self._uninstall()  # `fit` stops here; leave a plain model behind.
            raise RuntimeError(
                f"The `train_step` of model {self.model.name!r} applied "
                f"gradients through `self.optimizer` {len(applies)} times "
                f"(and called `self.optimizer.scale_loss()` {len(scales)} "
                "times) in one step. Gradient accumulation needs exactly one "
                "`self.optimizer.apply_gradients(zip(grads, variables))` (or "
                "`self.optimizer.apply(grads, variables)`) per step, and at "
                "most one `scale_loss()`: that is where the gradients are "
                "collected. A `train_step` that updates weights another way, "
                "or with several optimizers, is not supported."
            )
        return logs

    @contextlib.contextmanager
    def _patched_optimizer(self):
        """Routes the optimizer's `apply` (and `scale_loss`) to this hook.

        Patched only while steps run (in graph mode: while they trace), once
        for all replicas' threads, each of which finds its own `_Step`.
        """
        optimizer = self._optimizer
        patches = {self._api.apply_method: self._accumulating_apply}
        if (
            self._api.scales_loss_in_step
            and self.reduction == "samples"
            and not _keras.scales_loss_dynamically(optimizer)
        ):
            patches["scale_loss"] = self._sample_weighting_scale_loss
        with self._patch_lock:
            if not self._patch_depth:
                for name, patch in patches.items():
                    object.__setattr__(optimizer, name, patch)
            self._patch_depth += 1
        try:
            yield
        finally:
            with self._patch_lock:
                self._patch_depth -= 1
                if not self._patch_depth:
                    for name in patches:
                        object.__delattr__(optimizer, name)

    def _accumulating_apply(self, *args, **kwargs):
        step = self._local.step
        grads, trainable_variables = self._api.apply_arguments(*args, **kwargs)
        if trainable_variables is None:
            trainable_variables = self._optimizer._trainable_variables
        step.applies.append(None)
        self._accumulate(
            list(grads), list(trainable_variables), step.samples, bool(step.scales)
        )

    def _sample_weighting_scale_loss(self, loss):
        # Weighting the loss by the sample count weights every gradient at
        # once: cheaper than scaling each accumulated gradient.
        step = self._local.step
        step.scales.append(None)
        loss = type(self._optimizer).scale_loss(self._optimizer, loss)
        return loss * tf.cast(step.samples, loss.dtype)

    def _accumulator(self, variable):
        key = id(variable)
        if key not in self._accumulators:
            if self._replicas > 1 and not tf.executing_eagerly():
                raise ValueError(
                    f"Variable {variable.name!r} received a gradient but is "
                    "not among the model's trainable variables. With several "
                    "replicas, accumulators are made when the hook is "
                    "installed, from `model.trainable_variables`."
                )
            with tf.init_scope(), self._strategy.scope():
                # Each replica sums its own gradients; Keras' optimizer
                # all-reduces them once, when the window is applied.
                self._accumulators[key] = tf.Variable(
                    tf.zeros(variable.shape, _accumulator_dtype(variable)),
                    trainable=False,
                    name="accumulated_gradient",
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.SUM,
                )
        return self._accumulators[key]

    def _accumulate(self, grads, variables, samples, weighted_by_loss):
        if len(grads) != len(variables):
            raise ValueError(
                f"Received {len(grads)} gradients for {len(variables)} "
                "variables in `optimizer.apply()`."
            )
        self._applied = (variables, [grad is not None for grad in grads])
        optimizer = self._optimizer
        # Build its variables here, outside the update's `tf.cond`.
        with tf.init_scope():
            self._api.build_optimizer(optimizer, variables)

        def add():
            self._add_to_window(grads, variables, samples, weighted_by_loss)
            return self._first_replica_only(
                tf.constant(_MICRO_STEP, tf.int64)
            ) + samples * tf.constant(_SAMPLE, tf.int64)

        if self.skip_nonfinite:
            # A non-finite micro-batch is left out; the window goes on.
            delta = tf.cond(_all_finite(grads), add, self._leave_out)
        else:
            delta = add()
        # This update depends on `samples`, so on the micro-batch's data: when
        # a dataset of unknown length runs out, it cannot run before
        # `get_next()` fails (Keras' own `optimizer.iterations` can, and
        # counts a phantom step per epoch that way).
        self._counts.assign_add(delta)
        if self._replicas > 1:
            self._window_position.assign_add(1)
            # Keras' optimizer calls `merge_call`, which a `tf.cond` in a
            # replica context cannot hold (keras-team/keras#20582): decide in
            # the cross-replica context, as LossScaleOptimizer does.
            tf.distribute.get_replica_context().merge_call(
                self._end_window_if_full_on_replicas
            )
            return
        applied = tf.cond(
            self._counts[_WINDOW_MICRO] >= self._steps,
            self._end_window,
            lambda: tf.constant(False),
        )
        _keep_as_function_call(applied)

    def _first_replica_only(self, delta):
        """`delta` on the first replica, zero on the others (counts are summed)."""
        if self._replicas == 1:
            return delta
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return delta * tf.cast(tf.equal(replica, 0), delta.dtype)

    def _end_window_if_full_on_replicas(self, strategy):
        # Every replica, on every worker, holds the same position: read this
        # worker's own, and reduce the counts only when the window is applied.
        position = strategy.experimental_local_results(self._window_position)[0]
        return tf.cond(
            position >= self._steps,
            lambda: self._apply_on_replicas(self._counts.read_value()[:_WINDOW]),
            lambda: tf.constant(False),
        )

    def _apply_on_replicas(self, window, **extra_counts):
        self._strategy.extended.call_for_each_replica(
            self._apply_window, kwargs=dict(window=window, **extra_counts)
        )
        return tf.constant(True)

    def _add_to_window(self, grads, variables, samples, weighted_by_loss):
        weighted = self.reduction == "samples" and not weighted_by_loss
        scales = {}  # dtype -> -samples, computed once per step
        for grad, variable in zip(grads, variables):
            if grad is None:
                continue
            accumulator = self._accumulator(variable)
            dtype = accumulator.dtype
            if weighted and dtype not in scales:
                scales[dtype] = -tf.cast(samples, dtype)
            if isinstance(grad, tf.IndexedSlices):
                values = tf.cast(grad.values, dtype)
                if weighted:
                    values = values * -scales[dtype]
                accumulator.scatter_add(
                    tf.IndexedSlices(values, grad.indices, grad.dense_shape)
                )
            elif weighted:
                # accumulator -= (-samples) * grad, in one fused kernel.
                tf.raw_ops.ResourceApplyGradientDescent(
                    var=accumulator.handle,
                    alpha=scales[dtype],
                    delta=tf.cast(grad, dtype),
                )
            else:
                accumulator.assign_add(tf.cast(grad, dtype))
        if self.summaries is not None or self.noise is not None:
            # The micro-batch's own gradient norm: one read of the gradients.
            unscale = self._api.loss_scale(self._optimizer)
            if weighted_by_loss:
                weight = tf.cast(samples, tf.float32)
                unscale = weight if unscale is None else unscale * weight
            square = unscaled(
                squared_norm(grads), None if unscale is None else unscale**2
            )
            if self.summaries is not None:
                self.summaries.on_micro_step(tf.sqrt(square))
            if self.noise is not None:
                self.noise.on_micro_step(square, samples)

    def _leave_out(self):
        """Counts a non-finite micro-batch; lowers a dynamic loss scale."""
        optimizer = self._optimizer
        if _keras.scales_loss_dynamically(optimizer):
            # As Keras' LossScaleOptimizer does for a non-finite step. If
            # what the window holds was scaled by the old scale, rescale it.
            factor = self._api.lower_loss_scale(optimizer)
            if factor is not None:
                for accumulator in self._accumulators.values():
                    accumulator.assign(accumulator * factor)
        return tf.constant(_MICRO_STEP, tf.int64) + tf.constant(_NONFINITE, tf.int64)

    def _end_window(self, **extra_counts):
        """Applies the window (if any micro-batch in it counts), then resets."""
        window = self._counts.read_value()[:_WINDOW]
        contributing = window[_WINDOW_MICRO] - window[_WINDOW_NONFINITE]
        return tf.cond(
            contributing > 0,
            lambda: self._apply_window(**extra_counts),
            lambda: self._reset_window(window) or tf.constant(False),
        )

    def _apply_window(self, window=None, **extra_counts):
        """Applies the normalised window through the optimizer, then resets.

        With several replicas this runs on each, `window` holding the counts
        of all of them; the optimizer sums the replicas' gradients.
        """
        variables, has_gradient = self._applied
        counts = self._counts.read_value()  # this replica's
        local = counts[:_WINDOW]
        if window is None:
            window = local
        if self.reduction == "samples":
            # Keras divides each replica's loss by the number of replicas
            # and sums their gradients: undo the first, let it do the second.
            denominator = window[_WINDOW_SAMPLES]
            if self._replicas > 1:
                denominator = tf.cast(denominator, tf.float64) / self._replicas
        elif self.reduction == "mean":
            denominator = window[_WINDOW_MICRO] - window[_WINDOW_NONFINITE]
        else:
            denominator = None
        grads = []
        for variable, present in zip(variables, has_gradient):
            if not present:
                grads.append(None)
                continue
            grad = self._accumulators[id(variable)].read_value()
            if denominator is not None:
                grad = grad / tf.cast(denominator, grad.dtype)
            grads.append(tf.cast(grad, variable.dtype))
        observed = self.summaries is not None or self.noise is not None
        if observed:
            unscale = self._api.loss_scale(self._optimizer)  # before apply changes it
        self._api.apply(self._optimizer, grads, variables)
        for layer, _ in self._windowed_layers:
            layer._apply_window_moments()
        if self.noise is not None:
            self.noise.on_update(
                unscaled(squared_norm(grads), None if unscale is None else unscale**2),
                samples=window[_WINDOW_SAMPLES],
                micro_batches=window[_WINDOW_MICRO] - window[_WINDOW_NONFINITE],
            )
        if self.summaries is not None:
            self.summaries.on_update(
                grads,
                variables,
                unscale=unscale,
                step=self._optimizer.iterations,
                window=window,
                micro_steps=counts[_COUNTS.index("micro_steps")],
                updates=counts[_COUNTS.index("optimizer_steps")] + 1,
                nonfinite=counts[_COUNTS.index("nonfinite_skips")],
                noise_scale=None if self.noise is None else self.noise.current(),
                prefix=self.model.name + "/",
            )
        self._reset_window(local, optimizer_steps=1, **extra_counts)
        return tf.constant(True)

    def _reset_window(self, window=None, **extra_counts):
        """Zeroes the accumulators and takes `window` off the window counts."""
        for accumulator in self._accumulators.values():
            accumulator.assign(tf.zeros_like(accumulator))
        for _, pooled in self._windowed_layers:
            pooled.reset()
        if self.summaries is not None:
            self.summaries.on_window_reset()
        if self.noise is not None:
            self.noise.on_window_reset()
        if window is None:
            window = self._counts.read_value()[:_WINDOW]
        if self._replicas > 1:
            self._window_position.assign(0)
        self._counts.assign_add(
            _count_delta(
                window_micro_steps=-window[_WINDOW_MICRO],
                window_samples=-window[_WINDOW_SAMPLES],
                window_nonfinite=-window[_WINDOW_NONFINITE],
            )
            + self._first_replica_only(_count_delta(**extra_counts))
        )

    # -- host-triggered window ends -----------------------------------------

    def _compile(self, fn):
        if self.model.run_eagerly:
            return fn
        return tf.function(fn, autograph=False)

    def _flush_graph(self):
        window = self._counts.read_value()[:_WINDOW]
        if self._replicas > 1:
            apply = lambda: self._apply_on_replicas(window, flushes=1)  # noqa: E731
        else:
            apply = lambda: self._end_window(flushes=1)  # noqa: E731
        tf.cond(window[_WINDOW_MICRO] > 0, apply, lambda: tf.constant(False))
        return window[:2]

    def _drop_graph(self):
        window = self._counts.read_value()[:_WINDOW]
        self._strategy.extended.call_for_each_replica(self._drop_on_replica)
        return window[:2]

    def _drop_on_replica(self):
        local = self._counts.read_value()[:_WINDOW]
        self._reset_window(local, dropped_micro_steps=local[_WINDOW_MICRO])

    def flush(self):
        """Applies a partial window now, normalised by what it holds.

        Returns:
            The `Window` that was applied (`Window(0, 0)` if none was pending).
        """
        if self._applied is None:
            return Window(0, 0)
        if self._flush_function is None:
            self._flush_function = self._compile(self._flush_graph)
        with self._strategy.scope():
            micro_batches, samples = self._flush_function()
        return Window(int(micro_batches), int(samples))

    def drop(self):
        """Discards a partial window; it is counted in `dropped_micro_steps`.

        Returns:
            The `Window` that was discarded.
        """
        if self._applied is None:
            return Window(0, 0)
        if self._drop_function is None:
            self._drop_function = self._compile(self._drop_graph)
        with self._strategy.scope():
            micro_batches, samples = self._drop_function()
        return Window(int(micro_batches), int(samples))


def _all_finite(grads):
    return tf.reduce_all(
        tf.stack(
            [
                tf.reduce_all(
                    tf.math.is_finite(
                        grad.values if isinstance(grad, tf.IndexedSlices) else grad
                    )
                )
                for grad in grads
                if grad is not None
            ]
        )
    )


def _keep_as_function_call(cond_output):
    """Asks TensorFlow not to inline the update branch into the step's graph.

    Inlined (TensorFlow's default), every op of the optimizer update is
    visited on every micro-step, as a dead branch, though it runs once per
    window; kept as a function call, a micro-step skips it in one op. XLA
    compiles `If` itself and needs nothing. This sets the attribute that
    `tf.cond` sets for its own lowering choice; if TensorFlow changes it,
    the default (correct, slightly slower) is kept.
    """
    if tf.executing_eagerly():
        return
    try:
        from tensorflow.core.framework import attr_value_pb2

        op = cond_output.op
        while op.type not in ("If", "StatelessIf"):
            op = op.inputs[0].op
        op._set_attr("_lower_using_switch_merge", attr_value_pb2.AttrValue(b=False))
    except Exception:  # noqa: BLE001 - a missed speed-up, nothing worse
        pass


def install_accumulation_hook(
    model, *, accumulation_steps, reduction="samples", skip_nonfinite=None
):
    """Installs gradient accumulation on a compiled model and returns the hook.

    See `AccumulationHook` for the arguments; `hook.remove()` undoes it.

    Example:

    ```python
    with tfaccum.install_accumulation_hook(model, accumulation_steps=4):
        model.fit(x, y, batch_size=8)  # updates once every 4 batches
    ```
    """
    return AccumulationHook(
        model,
        accumulation_steps=accumulation_steps,
        reduction=reduction,
        skip_nonfinite=skip_nonfinite,
    )


def remove_accumulation_hook(model):
    """Removes the accumulation hook from `model`, if one is installed.

    Useful after `fit` was interrupted by an exception, which Keras does not
    report to callbacks.

    Returns:
        The removed `AccumulationHook`, or `None` if none was installed.
    """
    hook = AccumulationHook.installed_on(model)
    if hook is not None:
        hook.remove()
    return hook
