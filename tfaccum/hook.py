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
from tfaccum.items import LossCounting
from tfaccum.items import OnceWarner
from tfaccum.layers import window_observers
from tfaccum.observers import MicroStep
from tfaccum.observers import Update
from tfaccum.patching import InstancePatch
from tfaccum.patching import ModelInstallation
from tfaccum.patching import SharedPatches
from tfaccum.schedule import check_steps
from tfaccum.window import WINDOW_COUNTS
from tfaccum.window import AccumulationWindow
from tfaccum.window import OutputChannels

REDUCTIONS = ("auto", "samples", "mean", "sum")
SPARSE_GRADIENTS = ("rows", "dense")

Window = collections.namedtuple("Window", ["micro_batches", "samples"])
Window.__doc__ = """What an accumulation window held: micro-batches and samples."""

_HOOK_ATTRIBUTE = "_tfaccum_hook"


def check_reduction(reduction):
    return _check_choice("reduction", reduction, REDUCTIONS)


def check_sparse_gradients(sparse_gradients):
    return _check_choice("sparse_gradients", sparse_gradients, SPARSE_GRADIENTS)


def _check_choice(name, value, choices):
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"`{name}` must be one of {', '.join(map(repr, choices))}. "
            f"Received: {name}={value!r}"
        )
    return value


def check_skip_nonfinite(skip_nonfinite):
    if skip_nonfinite is not None and not isinstance(skip_nonfinite, bool):
        raise TypeError(
            "`skip_nonfinite` must be None, True or False. "
            f"Received: skip_nonfinite={skip_nonfinite!r}"
        )
    return skip_nonfinite


@dataclasses.dataclass
class _Step:
    """One micro-step being traced: its sample count and the calls it made."""

    samples: object
    applies: int = 0
    weighted_by_loss: bool = False
    scales: int = 0
    items: object = None  # an `ItemCount` under reduction="auto"
    count: object = None  # what its loss averages over (int64), once known
    weight: object = None  # the micro-batch's weight in its window, once known
    loss: object = None  # the step's loss (a mean), as the step computed it
    tape: object = None  # a persistent tape around the step (reduction="auto")
    uneven: object = None  # outputs that need their own window (`OutputChannels`)


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


class AccumulationHook:
    """Makes a compiled model update its weights once per window of micro-batches.

    Creating the hook installs it: the model's `train_step` gets wrapped so
    that the gradients its optimizer receives are summed into accumulators,
    and the optimizer is called once every `accumulation_steps` micro-batches
    with their normalised sum. `remove()` restores the plain model, and every
    attribute the hook set is put back as it was. The model's `train_step`
    (Keras' default, or an override) must apply its gradients through
    `self.optimizer.apply_gradients()` or `self.optimizer.apply()`, at most
    once per step; a step of a model with nothing to train passes through.

    A window that is not full is kept until `flush()` (apply it now,
    normalised by what it holds) or `drop()` (discard it). All per-step work
    runs inside the model's compiled train function; counters are read from
    the device only when you ask for them.

    The optimizer receives the gradient the large batch would have produced:
    the same values and the same type. A sparse (`IndexedSlices`) gradient,
    such as an embedding's, arrives as the window's rows in one
    `IndexedSlices` (with `sparse_gradients="rows"`).

    Args:
        model: A compiled Keras model.
        accumulation_steps: Integer >= 1, micro-batches per optimizer update.
            Change it between steps with `set_accumulation_steps()`.
        reduction: How the window's gradients are combined. `"auto"` weights
            each micro-batch by what its loss is an average over, and divides
            by the window's total, so a window is exactly one large batch:
            its samples, or, where a Keras mask or `ignore_class` reaches the
            loss, its unmasked elements (tokens); see `count_items()` for
            custom steps and losses. `"samples"` always weights by samples,
            `"mean"` gives each micro-batch equal weight (Keras' own
            accumulation), `"sum"` adds them without dividing. Defaults to
            `"auto"`.
        skip_nonfinite: Leave a micro-batch whose gradient holds a NaN or an
            infinity out of its window (counted in `nonfinite_skips`) instead
            of letting it spoil the window. Under mixed precision
            (`LossScaleOptimizer`) the loss scale is also halved, as Keras
            does. `None` (the default) turns it on exactly under
            `LossScaleOptimizer`, where overflow is expected; in float32 a
            non-finite gradient usually means divergence, which should show.
        sparse_gradients: `"rows"` (the default) keeps a sparse gradient's
            rows, so the optimizer receives the window's rows as the large
            batch's `IndexedSlices` (memory: the window's looked-up rows).
            `"dense"` scatter-adds them into a dense accumulator (memory: the
            whole variable) and the optimizer receives a dense gradient.
            Under `jit_compile=True` rows cannot be kept (XLA needs fixed
            shapes) and `"dense"` is used, with a warning.
        observers: `WindowObserver`s told of every micro-step, update and
            reset (e.g. `AccumulationSummaries`, `NoiseScaleEstimator`).
            `AccumBatchNormalization` layers of the model are observers too,
            added by the hook itself.

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
        reduction="auto",
        skip_nonfinite=None,
        sparse_gradients="rows",
        observers=(),
    ):
        api = _keras.api_for_model_argument(model, "model")
        self._api = api
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
        self.sparse_gradients = check_sparse_gradients(sparse_gradients)
        check_skip_nonfinite(skip_nonfinite)
        if skip_nonfinite is None:
            skip_nonfinite = _keras.scales_loss_dynamically(optimizer)
        self.skip_nonfinite = skip_nonfinite
        self._strategy = model.distribute_strategy
        self._replicas = self._strategy.num_replicas_in_sync
        # What Keras multiplies each replica's loss by (undone by the window).
        self._loss_share = _keras.replica_loss_share(model)
        if self._replicas > 1 and skip_nonfinite and self.reduction == "mean":
            raise ValueError(
                "skip_nonfinite (and mixed precision) with several replicas "
                "leaves out one replica's share of a micro-batch, which "
                'reduction="mean" (every micro-batch weighs the same) cannot '
                "weigh. Received: reduction='mean' with skip_nonfinite="
                f"{skip_nonfinite} under {type(self._strategy).__name__} with "
                f"{self._replicas} replicas. Use reduction='auto' or 'samples'."
            )
        self._optimizer = optimizer
        self._local = threading.local()  # the `_Step` being traced, per thread
        self._flush_function = None
        self._drop_function = None
        self._pending_function = None
        self._warned_dense = False
        self._loss_counting = None  # made at the first trace (reduction="auto")
        self._loss_seen = False  # whether the traced step showed its loss
        self._warn_items = OnceWarner()
        self.channels = None  # `OutputChannels`, if the step's outputs count differently
        self.window = AccumulationWindow(
            self._strategy,
            sparse_rows=sparse_gradients == "rows" and not model.jit_compile,
        )
        self.counts = self.window.counts
        with tf.init_scope(), self._strategy.scope():
            self._steps = tf.Variable(
                tf.ones((), tf.int64), trainable=False, name="accumulation_steps"
            )
        if self._replicas > 1 and model.built:
            # Variables cannot be made inside a replica's step.
            self.window.create_dense(model.trainable_variables)
        self.observers = list(observers) + window_observers(model, self._strategy)
        apply_method = api.apply_method
        optimizer_patches = [
            InstancePatch(optimizer, apply_method, self._accumulating_apply)
        ]
        # Where the step's loss passes: Keras 3's `scale_loss()`, tf_keras'
        # `minimize()`. Weighting the loss by the micro-batch's count weights
        # every gradient at once (cheaper than scaling each accumulated one),
        # except under dynamic loss scaling, whose scale must stay a power of 2.
        self._weights_in_loss = (
            api.scales_loss_in_step
            and self.reduction in ("auto", "samples")
            and not _keras.scales_loss_dynamically(optimizer)
        )
        self._loss_patch = InstancePatch(optimizer, api.loss_method, self._seeing_loss)
        optimizer_patches.append(self._loss_patch)
        # On while a step traces (or runs eagerly).
        self._optimizer_patches = SharedPatches(optimizer_patches)
        self._apply_patch = optimizer_patches[0]
        # On while the hook is installed.
        self._train_step_patch = InstancePatch(model, "train_step", self._train_step)
        self._installation = ModelInstallation(
            model, [self._train_step_patch, InstancePatch(model, _HOOK_ATTRIBUTE, self)]
        )
        # Whether a `fit` that owns the hook is in its training loop: `None`
        # for a hook installed by hand (any running `fit` counts).
        self._loop_running = None
        self.set_accumulation_steps(accumulation_steps)
        self._install()

    # -- installation ---------------------------------------------------

    @staticmethod
    def installed_on(model):
        """The hook installed on `model`, or `None`."""
        return model.__dict__.get(_HOOK_ATTRIBUTE)

    @property
    def installed(self):
        """Whether the hook is installed on its model now."""
        return self._installation.installed

    def _install(self):
        # Observers first: a layer's window must be in place before the
        # train step traces.
        for observer in self.observers:
            observer.on_install(self)
        self._installation.install()

    def can_reinstall(self):
        """Whether `reinstall()` can reuse this hook's compiled step.

        True unless the hook is installed, the model was compiled again, or
        its trainable variables or execution settings changed since.
        """
        if AccumulationHook.installed_on(self.model):
            return False
        return self._installation.can_reinstall()

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
        self.window.zero()
        if self.channels is not None:
            self.channels.reset()
        for observer in self.observers:
            observer.on_reset()
        self._install()

    def remove(self):
        """Restores the plain model. Warns if a window was left pending.

        Raises an error when called while the model's `fit` is running (from
        a callback): the running `fit` needs the train function it has.
        """
        if not self.installed:
            return
        if self._loop_running is not False and _keras.fit_is_running(self.model):
            raise RuntimeError(
                "The accumulation hook of model "
                f"{self.model.name!r} cannot be removed while its `fit` is "
                "running: the running `fit` calls the accumulating train "
                "function. To stop accumulating, stop training "
                "(`model.stop_training = True`); the callback removes the hook "
                "when `fit` ends. Received: a call to remove the hook from "
                "inside `fit`."
            )
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
        """Puts the model back as it was; observers are told first.

        The model is restored even if an observer raises (e.g. summaries
        that cannot be written); the error then propagates.
        """
        try:
            for observer in self.observers:
                observer.on_uninstall(self)
        finally:
            self._installation.uninstall()

    def _add_patch(self, patch):
        """Holds an `InstancePatch` while the hook is installed (restored on removal)."""
        return self._installation.add(patch)

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
        self._steps.assign(check_steps(accumulation_steps))

    # -- counters -----------------------------------------------------------

    @property
    def micro_steps(self):
        """Micro-batches trained on since the hook was installed."""
        return self.counts.numpy()["micro_steps"]

    @property
    def optimizer_steps(self):
        """Optimizer updates made since the hook was installed."""
        return self.counts.numpy()["optimizer_steps"]

    @property
    def flushes(self):
        """Partial windows applied by `flush()`."""
        return self.counts.numpy()["flushes"]

    @property
    def dropped_micro_steps(self):
        """Micro-batches discarded by `drop()`."""
        return self.counts.numpy()["dropped_micro_steps"]

    @property
    def nonfinite_skips(self):
        """Micro-batches left out of their window for non-finite gradients."""
        return self.counts.numpy()["nonfinite_skips"]

    @property
    def samples(self):
        """Samples whose gradients joined a window (left-out micro-batches excluded)."""
        return self.counts.numpy()["samples"]

    @property
    def items(self):
        """What those samples' losses averaged over: samples, or unmasked tokens.

        The unit windows are weighted by (under `reduction="auto"`); equal to
        `samples` for losses averaged per sample.
        """
        return self.counts.numpy()["items"]

    @property
    def pending(self):
        """The `Window` accumulated but not yet applied.

        With several replicas its samples are summed over them: every worker
        must read it (as it must call `flush()` and `drop()`).
        """
        if self._replicas > 1 and self.window.traced:
            if self._pending_function is None:
                self._pending_function = self._compile(self._pending_graph)
            with self._strategy.scope():
                micro_batches, samples = self._pending_function()
            return Window(int(micro_batches), int(samples))
        counts = self.counts.numpy()
        return Window(counts["window_micro_batches"], counts["window_samples"])

    def __repr__(self):
        counts = self.counts.numpy()
        return (
            f"AccumulationHook(model={self.model.name!r}, "
            f"accumulation_steps={self.accumulation_steps}, "
            f"reduction={self.reduction!r}, installed={self.installed}, "
            f"micro_steps={counts['micro_steps']}, "
            f"optimizer_steps={counts['optimizer_steps']})"
        )

    # -- the per-step graph ---------------------------------------------------

    def _train_step(self, data):
        step = _Step(samples=_count_samples(data))
        # MirroredStrategy traces the step of each replica in its own thread.
        self._local.step = step
        with self._optimizer_patches.active(), self._counting(step), self._recording(step):
            logs = self._train_step_patch.original()(data)
        if step.applies == 0 and not self.model.trainable_weights:
            # Nothing to train: Keras warns and skips the update; so do we.
            self.counts.add(self.counts.delta(micro_steps=1))
        elif step.applies != 1 or step.scales > 1:
            self._uninstall()  # `fit` stops here; leave a plain model behind.
            raise RuntimeError(
                f"The `train_step` of model {self.model.name!r} applied "
                f"gradients through `self.optimizer` {step.applies} times "
                f"(and called `self.optimizer.scale_loss()` {step.scales} "
                "times) in one step. Gradient accumulation needs exactly one "
                "`self.optimizer.apply_gradients(zip(grads, variables))` (or "
                "`self.optimizer.apply(grads, variables)`) per step, and at "
                "most one `scale_loss()`: that is where the gradients are "
                "collected. A `train_step` that updates weights another way, "
                "or with several optimizers, is not supported."
            )
        return logs

    @contextlib.contextmanager
    def _counting(self, step):
        """Under reduction="auto": what the step's loss averages over."""
        if self.reduction != "auto":
            yield
            return
        if self._loss_counting is None:  # the compiled loss is built by now
            self._loss_counting = LossCounting(self.model)
        with self._loss_counting.counting() as items:
            step.items = items
            yield

    @contextlib.contextmanager
    def _recording(self, step):
        """A persistent tape around the step, for outputs that count differently.

        Each such output's gradient is taken from it in `_micro_step`. Inside
        a traced step a tape nobody asks costs nothing at run time.
        """
        if self.reduction != "auto":
            yield
            return
        with tf.GradientTape(persistent=True) as tape:
            step.tape = tape
            yield

    def _uneven_outputs(self, step):
        """The outputs this step accumulates in windows of their own (or `[]`)."""
        if step.uneven is None:
            step.uneven = []
            if step.items is not None:
                uneven = step.items.uneven_outputs()
                if uneven and all(output.count is not None for output in uneven):
                    step.uneven = uneven
        return step.uneven

    def _weight(self, step):
        """The micro-batch's weight in its window (int64), resolved once.

        Its count (`step.count`: what its loss averages over), except for a
        micro-batch that counts nothing (every token masked: Keras makes its
        loss 0) while its window has counted nothing yet: weighted by its
        samples then, so that a window of only such micro-batches applies
        their mean gradient (the regularisers', as the large batch does).
        The first micro-batch that counts empties what they added.
        """
        if step.weight is None:
            if step.items is not None:
                step.count = step.items.resolve(step.samples, self._warn_items)
                open_items = self.counts.read()["window_items"]
                step.weight = tf.where(
                    step.count > 0, step.count,
                    tf.where(open_items > 0, tf.zeros_like(step.samples), step.samples))
            else:
                step.count = step.weight = step.samples
        return step.weight

    # The hook's graph code needs no AutoGraph (tf_keras converts the train
    # step, and with it whatever the step calls; TensorFlow 2.16's converter
    # mangles some of this code). The user's own step stays converted.
    @tf.autograph.experimental.do_not_convert
    def _accumulating_apply(self, *args, **kwargs):
        step = self._local.step
        grads, variables = self._api.apply_arguments(*args, **kwargs)
        if variables is None:
            variables = _keras.optimizer_variables(self._optimizer)
        step.applies += 1
        grads, variables = list(grads), list(variables)
        if len(grads) != len(variables):
            raise ValueError(
                f"Received {len(grads)} gradients for {len(variables)} "
                "variables in `optimizer.apply()`."
            )
        if not grads:
            step.applies -= 1  # Keras' `apply([])` is a no-op: pass through
            return
        self._micro_step(grads, variables, step)

    @tf.autograph.experimental.do_not_convert
    def _seeing_loss(self, loss, *args, **kwargs):
        """The optimizer's `scale_loss` (Keras 3) or `minimize` (tf_keras), noting the loss."""
        step = self._local.step
        step.scales += 1
        if tf.is_tensor(loss):
            step.loss = loss
        result = self._loss_patch.original()(loss, *args, **kwargs)
        if self._weights_in_loss and not self._uneven_outputs(step):
            step.weighted_by_loss = True
            result = result * tf.cast(self._weight(step), result.dtype)
        return result

    def _micro_step(self, grads, variables, step):
        window = self.window
        if self._replicas > 1 and not tf.executing_eagerly():
            for grad, variable in zip(grads, variables):
                if grad is not None and not window.has_accumulator(variable):
                    raise ValueError(
                        f"Variable {variable.name!r} received a gradient but "
                        "is not among the model's trainable variables. With "
                        "several replicas, accumulators are made when the hook "
                        "is installed, from `model.trainable_variables`."
                    )
        window.track(grads, variables)
        self._warn_if_densified(grads, variables)
        # Build its variables here, outside the update's `tf.cond`.
        with tf.init_scope():
            self._api.build_optimizer(self._optimizer, variables)
        samples = step.samples
        weight = self._weight(step)
        items = step.count
        uneven = self._uneven_outputs(step)
        window_grads, window_loss = grads, step.loss
        if uneven:
            if self.channels is None:
                self._make_channels(uneven, variables)
            elif self.channels.names != [o.name for o in uneven]:
                raise ValueError(
                    f"The outputs whose losses count differently changed between "
                    f"traces: {self.channels.names} then {[o.name for o in uneven]}.")
            window_grads, per_output = self._split_by_output(step, uneven, grads, variables)
            if window_loss is not None:  # what the outputs' windows do not hold
                window_loss = window_loss - tf.add_n([
                    tf.cast(o.value, window_loss.dtype) * weight
                    for o, weight in zip(uneven, self.channels.weights)])
            self.channels.track(per_output, variables)
        gradient_scale = self._api.loss_scale(self._optimizer)
        if step.weighted_by_loss:
            factor = tf.cast(weight, tf.float32)
            gradient_scale = factor if gradient_scale is None else gradient_scale * factor
        if self._loss_share != 1.0:
            # Keras divides each replica's loss by the number of replicas.
            share = tf.constant(self._loss_share, tf.float32)
            gradient_scale = share if gradient_scale is None else gradient_scale * share
        micro = MicroStep(
            grads=grads,
            variables=variables,
            samples=samples,
            items=items,
            gradient_scale=gradient_scale,
            mean_divisor=samples if self.reduction == "sum" else None,
        )
        weighted = self.reduction in ("auto", "samples") and not step.weighted_by_loss
        counts = self.counts

        self._loss_seen = self._loss_seen or step.loss is not None
        observers = self._observers_here()
        # With several replicas the totals are added from the reduced window.
        totals = dict(samples=samples, items=items) if self._replicas == 1 else {}

        def add():
            if step.items is not None:
                self._forget_uncounted(items)
            window.add(
                window_grads, variables, weight if weighted else None, loss=window_loss,
                items=items, samples=samples,
            )
            if uneven:
                self.channels.add(per_output, variables, [o.count for o in uneven],
                                  [o.value for o in uneven])
            for observer in observers:
                observer.on_micro_step(micro)
            return counts.delta(
                micro_steps=1,
                window_micro_batches=1,
                window_samples=samples,
                window_items=items,
                **totals,
            )

        def leave_out():
            if self._replicas == 1:
                self._lower_loss_scale()  # with several, at the window's end
            for observer in observers:
                observer.on_leave_out(micro)
            return counts.delta(
                micro_steps=1,
                window_micro_batches=1,
                window_nonfinite=1,
                **({"nonfinite_skips": 1} if self._replicas == 1 else {}),
            )

        if self.skip_nonfinite:
            delta = tf.cond(_all_finite(grads), add, leave_out)
        else:
            delta = add()
        # This update depends on `samples`, so on the micro-batch's data: when
        # a dataset of unknown length runs out, it cannot run before
        # `get_next()` fails (Keras' own `optimizer.iterations` can, and
        # counts a phantom step per epoch that way).
        counts.add(delta)
        if self._replicas > 1:
            # Keras' optimizer calls `merge_call`, which a `tf.cond` in a
            # replica context cannot hold (keras-team/keras#20582): decide in
            # the cross-replica context, as LossScaleOptimizer does.
            tf.distribute.get_replica_context().merge_call(
                self._end_window_if_full_on_replicas
            )
            return
        applied = tf.cond(
            counts.read()["window_micro_batches"] >= self._steps,
            self._end_window,
            lambda: tf.constant(False),
        )
        _keras.keep_as_function_call(applied)

    def _forget_uncounted(self, items):
        """Empties the accumulators when the first micro-batch that counts joins a window
        of micro-batches that counted nothing (see `_weight`)."""
        counts = self.counts.read()
        uncounted = tf.logical_and(counts["window_items"] <= 0, counts["window_samples"] > 0)

        def forget():
            self.window.clear_gradients()
            return tf.constant(True)

        tf.cond(tf.logical_and(uncounted, items > 0), forget, lambda: tf.constant(False))

    def _make_channels(self, uneven, variables):
        """Makes `self.channels` while the step traces (once, for every replica).

        With several replicas its accumulators are made in the cross-replica
        context, where variables can be created, dense (as the main window's).
        """

        def make(strategy=None):
            if self.channels is not None:  # another replica's thread made them
                return
            channels = OutputChannels(
                self._strategy, [o.name for o in uneven], [o.weight for o in uneven],
                sparse_rows=self.window.sparse_rows, loss_share=self._loss_share)
            if strategy is not None:
                for window in channels.windows:
                    window.create_dense([v for v in variables if self.window.has_accumulator(v)])
            self.channels = channels

        if self._replicas > 1:
            tf.distribute.get_replica_context().merge_call(make)
        else:
            make()

    def _split_by_output(self, step, uneven, grads, variables):
        """Each uneven output's share of `grads`, and the rest.

        An output's share is its loss's gradient taken from the step's tape,
        times its loss weight (`self.channels.weights`) and the optimizer's
        loss scale: in the units of `grads`. The rest (outputs that count
        samples, regularization) is `grads` minus the shares.
        """
        scale = self._api.loss_scale(self._optimizer)
        per_output = []
        with step.tape.stop_recording():
            for output, factor in zip(uneven, self.channels.weights):
                shares = step.tape.gradient(output.value, variables)
                per_output.append([
                    _share_like(grad, share, factor, scale, variable)
                    for grad, share, variable in zip(grads, shares, variables)
                ])
        rest = [
            _minus(grad, [shares[i] for shares in per_output]) for i, grad in enumerate(grads)
        ]
        return rest, per_output

    def _warn_if_densified(self, grads, variables):
        if self._warned_dense or self.sparse_gradients != "rows":
            return
        densified = [
            variable.name
            for grad, variable in zip(grads, variables)
            if isinstance(grad, tf.IndexedSlices) and not self.window.uses_rows(variable)
        ]
        if densified:
            self._warned_dense = True
            reason = (
                "jit_compile=True (XLA needs fixed shapes)"
                if self.model.jit_compile
                else "several replicas"
            )
            warnings.warn(
                f"Sparse gradients of {densified} are accumulated densely under "
                f"{reason}: the optimizer receives a dense gradient, which "
                "optimizers that treat sparse rows one by one (Adam, Adagrad) "
                "apply differently from the large batch's rows. Pass "
                "sparse_gradients='dense' to accept this without a warning.",
                stacklevel=2,
            )

    def _lower_loss_scale(self):
        """Lowers a dynamic loss scale after a non-finite micro-batch, as Keras does."""
        optimizer = self._optimizer
        if _keras.scales_loss_dynamically(optimizer):
            # What the window holds was scaled by the old scale: rescale it.
            factor = self._api.lower_loss_scale(optimizer)
            if factor is not None:
                self.window.scale(factor)
                if self.channels is not None:
                    self.channels.scale(factor)

    def _observers_here(self):
        """The observers this replica feeds (at trace time).

        With several replicas, those that watch the window as a whole are fed
        by this machine's first replica only: its micro-batches, and the
        window reduced over every replica. Nothing crosses devices for them.
        """
        if self._replicas == 1:
            return self.observers
        context = tf.distribute.get_replica_context()
        replica = tf.get_static_value(context.replica_id_in_sync_group)
        if replica is None and not all(o.per_replica for o in self.observers):
            raise ValueError(
                f"{type(self._strategy).__name__} does not say which replica a "
                "step runs on while it traces; the summaries (log_dir) and the "
                "noise scale need it. Received: observers "
                f"{[type(o).__name__ for o in self.observers]}. Turn them off "
                "(log_dir=None, noise_scale=False) under this strategy."
            )
        local_replicas = len(self._strategy.extended.worker_devices)
        first = replica is not None and replica % local_replicas == 0
        return [o for o in self.observers if first or o.per_replica]

    def _end_window_if_full_on_replicas(self, strategy):
        # Every replica, on every worker, holds the same position in the
        # window: read this worker's own; counts are reduced only when the
        # window is applied.
        position = self.counts.local()[self.counts.names.index("window_micro_batches")]
        return tf.cond(
            position >= self._steps,
            lambda: self._end_window_on_replicas(self._global_window()),
            lambda: tf.constant(False),
        )

    def _end_window_on_replicas(self, window, **extra_counts):
        """Ends the window on every replica, from its reduced counts (cross-replica).

        A replica that left its share of a micro-batch out (non-finite) kept
        the loss scale: the window's gradients were all scaled alike. It is
        lowered once here, after the update, if any share was left out.
        """
        applied = tf.cond(
            window["window_samples"] > 0,
            lambda: self._apply_on_replicas(window, **extra_counts),
            lambda: self._skip_on_replicas(window),
        )
        if self.skip_nonfinite and _keras.scales_loss_dynamically(self._optimizer):
            lowered = tf.cond(
                window["window_nonfinite"] > 0,
                lambda: self._lower_scale_on_replicas(),
                lambda: tf.constant(False),
            )
            with tf.control_dependencies([applied, lowered]):
                applied = tf.identity(applied)
        return applied

    def _lower_scale_on_replicas(self):
        self._api.lower_loss_scale(self._optimizer)
        return tf.constant(True)

    def _skip_on_replicas(self, window):
        """Every share of every micro-batch was left out: no update."""
        self._api.count_skipped_update(self._optimizer)
        self._strategy.extended.call_for_each_replica(self._skip_on_replica, args=(window,))
        return tf.constant(False)

    def _skip_on_replica(self, window):
        self._reset(self._local_window(), window)

    def _global_window(self):
        """The open window's counts (and loss sum) over all replicas, cross-replica."""
        counts = self.counts.global_read()
        window = {name: counts[name] for name in WINDOW_COUNTS}
        window["loss_sum"] = self.window.loss_sum.read_value()
        if self.channels is not None:
            window.update(self.channels.global_read())
        return window

    def _apply_on_replicas(self, window, **extra_counts):
        with self._api.own_reduction_off(self._optimizer):
            self._strategy.extended.call_for_each_replica(
                self._apply_window, kwargs=dict(window=window, **extra_counts)
            )
        return tf.constant(True)

    def _end_window(self, **extra_counts):
        """Applies the window (if any micro-batch in it counts), then resets."""
        window = self._local_window()
        contributing = window["window_micro_batches"] - window["window_nonfinite"]
        return tf.cond(
            contributing > 0,
            lambda: self._apply_window(**extra_counts),
            lambda: self._skip_window(window),
        )

    def _skip_window(self, window):
        """Ends a window whose every micro-batch was left out: no update."""
        self._api.count_skipped_update(self._optimizer)
        self._reset(window)
        return tf.constant(False)

    def _local_window(self):
        counts = self.counts.read()
        window = {name: counts[name] for name in WINDOW_COUNTS}
        window["loss_sum"] = self.window.loss_sum.read_value()
        return window

    def _denominator(self, window, local):
        """What the window's sum is divided by, for `self.reduction`.

        `local`: this replica's window (the same as `window` on one device).
        """
        if self.reduction in ("auto", "samples"):
            # Keras divides each replica's loss by the number of replicas
            # (`_loss_share`) and sums their gradients: undo the first, let
            # it do the second.
            if self.reduction == "auto":
                denominator = _counted_or_samples(window)
            else:
                denominator = window["window_samples"]
            if self._replicas > 1:
                denominator = tf.cast(denominator, tf.float64) * self._loss_share
                if self.reduction == "auto":
                    # A replica whose share counted nothing in a window that
                    # counted something holds only uncounted micro-batches.
                    kept = tf.logical_or(local["window_items"] > 0, window["window_items"] <= 0)
                    denominator = tf.where(kept, denominator, float("inf"))
            return denominator
        if self.reduction == "mean":
            micro_batches = window["window_micro_batches"] - window["window_nonfinite"]
            if self._replicas > 1 and self._loss_share * self._replicas != 1.0:
                # A Keras that does not divide each replica's loss: the sum of
                # the replicas' mean losses is replicas times the micro-batch's.
                micro_batches = tf.cast(micro_batches, tf.float64) * self._replicas
            return micro_batches
        return None

    def _apply_window(self, window=None, **extra_counts):
        """Applies the normalised window through the optimizer, then resets.

        With several replicas this runs on each, `window` holding the counts
        of all of them; the optimizer sums the replicas' gradients.
        """
        counts = self.counts.read()  # this replica's
        local = self._local_window()
        window = local if window is None else window
        if self._replicas > 1:  # what the reduced window adds to the totals
            counts = dict(counts, nonfinite_skips=counts["nonfinite_skips"]
                          + window["window_nonfinite"])
        grads = self.window.gradients(self._denominator(window, local))
        if self.channels is not None:
            grads = self.channels.combine(grads, window.get("channel_items"))
        variables = self.window.variables
        gradient_scale = self._api.loss_scale(self._optimizer)  # before apply
        reduced = self._replicas > 1
        if reduced:
            # Applied as on one device: the optimizer receives (and clips)
            # the window's gradient summed over replicas.
            grads = _keras.all_reduce_sum(grads)
        self._api.apply(self._apply_patch.original(), grads, variables, reduced=reduced)
        update = Update(
            grads=grads,
            variables=variables,
            gradient_scale=gradient_scale,
            window=window,
            counts=counts,
            iterations=_keras.iterations(self._optimizer),
            mean_divisor=window["window_samples"] if self.reduction == "sum" else None,
            loss=self._window_loss(window) if self._loss_seen else None,
            name_prefix=self.model.name + "/",
        )
        for observer in self._observers_here():
            observer.on_apply(update)
        self._reset(local, window, optimizer_steps=1, **extra_counts)
        return tf.constant(True)

    def _window_loss(self, window):
        """The window's loss, weighted as its gradient (float64).

        Keras divides each replica's loss by the number of replicas: undone.
        """
        counted = window["window_items"] > 0
        loss_sum = tf.where(counted, window["loss_sum"][0], window["loss_sum"][1])
        denominator = tf.maximum(tf.cast(_counted_or_samples(window), tf.float64), 1.0)
        loss = loss_sum / denominator / self._loss_share
        if self.channels is not None:
            loss += self.channels.loss(
                window.get("channel_items"), window.get("channel_loss_sums"))
        return loss

    def _reset(self, local_window, window=None, **extra_counts):
        """Empties the window: accumulators, observers and this replica's window counts.

        With several replicas `window` is the window reduced over them, whose
        samples and items join the totals.
        """
        self.window.reset()
        if self.channels is not None:
            self.channels.reset()
        for observer in self._observers_here():
            observer.on_reset()
        if self._replicas > 1:
            extra_counts.update(samples=window["window_samples"], items=window["window_items"],
                                nonfinite_skips=window["window_nonfinite"])
        counts = self.counts
        counts.add(
            counts.delta(**{name: -local_window[name] for name in WINDOW_COUNTS})
            + counts.delta(**extra_counts)
        )

    # -- host-triggered window ends -----------------------------------------

    def _compile(self, fn):
        if self.model.run_eagerly:
            return fn
        return tf.function(fn, autograph=False)

    def _flush_graph(self):
        window = self._global_window()
        if self._replicas > 1:
            apply = lambda: self._end_window_on_replicas(window, flushes=1)  # noqa: E731
        else:
            apply = lambda: self._end_window(flushes=1)  # noqa: E731
        tf.cond(window["window_micro_batches"] > 0, apply, lambda: tf.constant(False))
        return window["window_micro_batches"], window["window_samples"]

    def _drop_graph(self):
        window = self._global_window()
        self._strategy.extended.call_for_each_replica(self._drop_on_replica, args=(window,))
        return window["window_micro_batches"], window["window_samples"]

    def _drop_on_replica(self, window):
        local = self._local_window()
        self._reset(local, window, dropped_micro_steps=local["window_micro_batches"])

    def _pending_graph(self):
        window = self._global_window()
        return window["window_micro_batches"], window["window_samples"]

    def flush(self):
        """Applies a partial window now, normalised by what it holds.

        Returns:
            The `Window` that was applied (`Window(0, 0)` if none was pending).
        """
        if not self.window.traced:
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
        if not self.window.traced:
            return Window(0, 0)
        if self._drop_function is None:
            self._drop_function = self._compile(self._drop_graph)
        with self._strategy.scope():
            micro_batches, samples = self._drop_function()
        return Window(int(micro_batches), int(samples))


def _counted_or_samples(window):
    """The window's items, or its samples where it counted no item (see `_weight`)."""
    return tf.where(window["window_items"] > 0, window["window_items"], window["window_samples"])


def _share_like(grad, share, factor, scale, variable):
    """`share * factor * scale` in the form of `grad` (`None`, dense or the same rows)."""
    if grad is None:
        return None
    if share is None:  # this output does not reach the variable
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(tf.zeros_like(grad.values), grad.indices, grad.dense_shape)
        return tf.zeros_like(grad)
    if isinstance(grad, tf.IndexedSlices) != isinstance(share, tf.IndexedSlices):
        if isinstance(grad, tf.IndexedSlices):
            raise ValueError(
                f"Variable {variable.name!r} receives a sparse gradient from the "
                "whole loss but a dense one from one output's loss: tfaccum cannot "
                "split it by output. Pass sparse_gradients=\"dense\" to the callback."
            )
        share = tf.convert_to_tensor(share)

    def scaled(values):
        values = tf.cast(values, grad.dtype) * factor
        return values if scale is None else values * tf.cast(scale, values.dtype)

    if isinstance(share, tf.IndexedSlices):
        return tf.IndexedSlices(scaled(share.values), share.indices, share.dense_shape)
    return scaled(share)


def _minus(grad, shares):
    """`grad` minus `shares` (each `None` where `grad` is; rows of the same indices)."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values - tf.add_n([share.values for share in shares])
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return grad - tf.add_n(shares)


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


def install_accumulation_hook(
    model,
    *,
    accumulation_steps,
    reduction="auto",
    skip_nonfinite=None,
    sparse_gradients="rows",
):
    """Installs gradient accumulation on a compiled model and returns the hook.

    See `AccumulationHook` for the arguments; `hook.remove()` undoes it. The
    hook stays installed until removed, across any number of `fit` calls.

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
        sparse_gradients=sparse_gradients,
    )


def remove_accumulation_hook(model):
    """Removes the accumulation hook from `model`, if one is installed.

    Returns:
        The removed `AccumulationHook`, or `None` if none was installed.
    """
    _keras.api_for_model_argument(model, "model")
    hook = AccumulationHook.installed_on(model)
    if hook is not None:
        hook.remove()
    return hook
