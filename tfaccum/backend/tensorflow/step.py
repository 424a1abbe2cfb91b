"""What one micro-step produced, found while the model's train step traces.

`StepTracer` wraps a model's `train_step`: while it runs (traces, or runs
eagerly) the optimizer's `apply`/`apply_gradients` and `scale_loss`/`minimize`
are patched, the micro-batch's samples and what its loss averages over are
counted, and the step's gradients are handed on, once, as one immutable
`MicroBatch`. Nothing here keeps state across steps.
"""

import contextlib
import dataclasses
import threading

import tensorflow as tf

from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow import gradients
from tfaccum.backend.tensorflow.loss_counting import LossCounting
from tfaccum.backend.tensorflow.loss_counting import OnceWarner
from tfaccum.patching import InstancePatch
from tfaccum.patching import SharedPatches


@dataclasses.dataclass(frozen=True)
class OutputShare:
    """One output whose loss averages over a count of its own, as a micro-step gave it.

    Attributes:
        name: The output's name.
        loss_weight: Its `loss_weights` entry (1.0 for none).
        count: What its loss averaged over (int64).
        value: Its loss (a mean over `count`).
        grads: Its loss's gradients, times its loss weight and the loss scale.
    """

    name: str
    loss_weight: float
    count: object
    value: object
    grads: tuple


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One micro-step's gradients and what they stand for.

    Attributes:
        grads: The gradients the step handed the optimizer (`None` where a
            variable got none).
        variables: Their variables.
        samples: Samples in the micro-batch (int64; this replica's).
        items: What its loss averages over (int64): its samples, or its
            unmasked items (tokens).
        every_sample_counts: Whether `items` is above 0 in every micro-batch
            with a sample, known while tracing (samples, or a fixed number of
            elements per sample; not a mask or `count_items()`).
        weight: Its weight in the window (the reduction's), or `None`.
        weighted: Whether `grads` already carry `weight` (it rode on the loss).
        loss: The step's loss (a mean), or `None` if the step did not show it.
        gradient_scale: What `grads` are multiplied by relative to the
            gradient of the micro-batch's own mean loss (loss scaling, the
            weight riding on the loss, a replica's loss share), or `None`.
        outputs: `OutputShare`s of the outputs that count differently (empty
            for most models).
        rest_grads: `grads` minus those outputs' shares (`grads` if none).
        rest_loss: `loss` minus those outputs' weighted losses.
    """

    grads: tuple
    variables: tuple
    samples: object
    items: object
    weight: object
    weighted: bool
    loss: object
    gradient_scale: object
    every_sample_counts: bool = False
    outputs: tuple = ()
    rest_grads: tuple = ()
    rest_loss: object = None


class StepError(RuntimeError):
    """A train step tfaccum cannot accumulate (the hook uninstalls itself)."""

    # AutoGraph (tf_keras converts the train step) re-raises an error of its
    # own type only where the type's constructor is `Exception`'s; others
    # reach the user as a `StagingError`.
    __init__ = Exception.__init__


class _Step:
    """A step being traced: what it did so far (per thread)."""

    def __init__(self, samples):
        self.samples = samples
        self.applies = 0
        self.scales = 0
        self.loss = None
        self.count = None  # an `ItemCount`, where items are counted
        self.tape = None
        self.items = None
        self.every_sample_counts = False
        self.weight = None
        self.weighted = False
        self.others = []  # the model's other optimizers that applied gradients


class StepTracer:
    """Turns a model's train step into `MicroBatch`es handed to `on_micro_batch`.

    Args:
        model: The compiled Keras model.
        counts_items: Whether to find what each micro-batch's loss averages
            over (`LossCounting`, `count_items()`); else its samples.
        weigh: `weigh(samples, items, every_sample_counts)`: the micro-batch's
            weight (a tensor) or `None`; called once per step, while it traces.
        weight_in_loss: Whether the weight may ride on the loss (multiplied
            in `scale_loss`, one multiply instead of one per gradient).
        loss_share: What Keras multiplies each replica's loss by.
        on_micro_batch: Called with each `MicroBatch`, inside the step.
    """

    def __init__(self, model, *, counts_items, weigh, weight_in_loss, loss_share,
                 on_micro_batch):
        self.model = model
        self._api = _keras_on_tf.api_for(model)
        self._optimizer = model.optimizer
        self._counts_items = counts_items
        self._weigh = weigh
        self._weight_in_loss = weight_in_loss
        self._loss_share = loss_share
        self._on_micro_batch = on_micro_batch
        self._local = threading.local()  # MirroredStrategy traces replicas in threads
        self._loss_counting = None  # made at the first trace (the loss is built by then)
        self._several_losses = None  # whether a tape must record the step (first trace)
        self._warn_items = OnceWarner()
        self._apply_patch = InstancePatch(self._optimizer, self._api.apply_method, self._apply)
        self._loss_patch = InstancePatch(self._optimizer, self._api.loss_method, self._scale_loss)
        # The model's other optimizers (a GAN's) are watched: an update
        # through them could not be accumulated.
        self._others = _keras_on_tf.other_optimizers(model)
        others = [InstancePatch(optimizer, self._api.apply_method, None)
                  for _, optimizer in self._others]
        for (name, _), patch in zip(self._others, others):
            patch.value = self._other_apply(name, patch)
        self._patches = SharedPatches([self._apply_patch, self._loss_patch] + others)

    def apply_gradients(self, grads, variables, reduced=False):
        """Applies `grads` through the optimizer's own (unpatched) method."""
        self._api.apply(self._apply_patch.original(), grads, variables, reduced=reduced)

    # -- the wrapped train step ------------------------------------------------

    def train_step(self, original, data):
        """Runs `original(data)` (the model's own step), collecting its micro-batch."""
        step = _Step(count_samples(data))
        self._local.step = step
        with self._patches.active(), self._counting(step), self._recording(step):
            logs = original(data)
        if step.applies == 0 and not self.model.trainable_weights:
            return logs, "nothing to train"
        known = {id(optimizer) for _, optimizer in self._others}
        made = [name for name, optimizer in _keras_on_tf.other_optimizers(self.model)
                if id(optimizer) not in known]
        if step.others or made:
            raise StepError(
                f"The `train_step` of model {self.model.name!r} updates weights through "
                "optimizers other than `self.optimizer`: "
                f"{sorted(set(step.others))} applied gradients"
                f"{f' and {made} were made in the step' if made else ''}. "
                "Gradient accumulation collects the gradients of the model's one "
                "optimizer, `self.optimizer`; a `train_step` with several optimizers "
                "(a GAN's generator and discriminator) is not supported. Train it "
                "without accumulation, or accumulate each part as a model of its own."
            )
        if step.applies != 1 or step.scales > 1:
            raise StepError(
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
        return logs, None

    @contextlib.contextmanager
    def _counting(self, step):
        if not self._counts_items:
            yield
            return
        if self._loss_counting is None:  # the compiled loss is built by now
            self._loss_counting = LossCounting(self.model)
        with self._loss_counting.counting() as count:
            step.count = count
            yield

    @contextlib.contextmanager
    def _recording(self, step):
        """A persistent tape around the step, where outputs may count differently.

        Each such output's gradient is taken from it. Only models whose
        compiled loss may hold several losses record: a persistent tape
        around the model's own keeps about one more copy of the gradients
        alive in the step (0.7 parameter bytes of peak memory measured on
        a 19M-weight MLP; benchmarks/memory.py).
        """
        if self._several_losses is None:
            self._several_losses = (self._counts_items
                                    and _keras_on_tf.may_hold_several_losses(self.model))
        if not self._several_losses:
            yield
            return
        with tf.GradientTape(persistent=True) as tape:
            step.tape = tape
            yield

    def _uneven(self, step):
        """The outputs this step accumulates in windows of their own (or `[]`)."""
        if step.count is None:
            return []
        uneven = step.count.uneven_outputs()
        if uneven and all(output.count is not None for output in uneven):
            if step.tape is None:
                raise StepError(
                    f"Model {self.model.name!r} computed {len(step.count.per_output)} "
                    "compiled losses in one step where its compile showed one: "
                    "tfaccum recorded no tape to split the gradients by output. "
                    "Compile the model with one loss per output (a list or dict).")
            return uneven
        return []

    def _resolve(self, step):
        """The micro-batch's items and weight, resolved once."""
        if step.items is None:
            if step.count is not None:
                step.items, step.every_sample_counts = step.count.resolve(
                    step.samples, self._warn_items)
            else:
                step.items = step.samples
                step.every_sample_counts = True
            step.weight = self._weigh(step.samples, step.items, step.every_sample_counts)

    def _other_apply(self, name, patch):
        @tf.autograph.experimental.do_not_convert
        def apply(*args, **kwargs):
            self._local.step.others.append(name)
            return patch.original()(*args, **kwargs)

        return apply

    # The hook's graph code needs no AutoGraph (tf_keras converts the train
    # step, and with it whatever the step calls; TensorFlow 2.16's converter
    # mangles some of this code). The user's own step stays converted.
    @tf.autograph.experimental.do_not_convert
    def _scale_loss(self, loss, *args, **kwargs):
        """The optimizer's `scale_loss` (Keras 3) or `minimize` (tf_keras), noting the loss."""
        step = self._local.step
        step.scales += 1
        if tf.is_tensor(loss):
            step.loss = loss
        result = self._loss_patch.original()(loss, *args, **kwargs)
        if self._weight_in_loss and not self._uneven(step):
            self._resolve(step)
            if step.weight is not None:
                step.weighted = True
                result = result * tf.cast(step.weight, result.dtype)
        return result

    @tf.autograph.experimental.do_not_convert
    def _apply(self, *args, **kwargs):
        step = self._local.step
        grads, variables = self._api.apply_arguments(*args, **kwargs)
        if variables is None:
            variables = _keras_on_tf.optimizer_variables(self._optimizer)
        grads, variables = list(grads), list(variables)
        if len(grads) != len(variables):
            raise ValueError(
                f"Received {len(grads)} gradients for {len(variables)} "
                "variables in `optimizer.apply()`."
            )
        if not grads:
            return  # Keras' `apply([])` is a no-op: pass through
        step.applies += 1
        # Its variables (the loss scale among them) are made here, outside
        # the update's `tf.cond`.
        with tf.init_scope():
            self._api.build_optimizer(self._optimizer, variables)
        self._on_micro_batch(self._micro_batch(step, grads, variables))

    def _micro_batch(self, step, grads, variables):
        self._resolve(step)
        scale = self._api.loss_scale(self._optimizer)
        gradient_scale = scale
        if step.weighted:
            factor = tf.cast(step.weight, tf.float32)
            gradient_scale = factor if gradient_scale is None else gradient_scale * factor
        if self._loss_share != 1.0:
            # Keras divides each replica's loss by the number of replicas.
            share = tf.constant(self._loss_share, tf.float32)
            gradient_scale = share if gradient_scale is None else gradient_scale * share
        outputs, rest_grads, rest_loss = (), tuple(grads), step.loss
        uneven = self._uneven(step)
        if uneven:
            outputs = self._split(step, uneven, grads, variables, scale)
            rest_grads = tuple(
                gradients.minus(grad, [output.grads[i] for output in outputs])
                for i, grad in enumerate(grads))
            if rest_loss is not None:  # what the outputs' windows do not hold
                rest_loss = rest_loss - tf.add_n([
                    tf.cast(output.value, rest_loss.dtype) * output.loss_weight
                    for output in outputs])
        return MicroBatch(
            grads=tuple(grads), variables=tuple(variables), samples=step.samples,
            items=step.items, weight=step.weight, weighted=step.weighted, loss=step.loss,
            gradient_scale=gradient_scale, every_sample_counts=step.every_sample_counts,
            outputs=outputs, rest_grads=rest_grads,
            rest_loss=rest_loss)

    def _split(self, step, uneven, grads, variables, scale):
        """Each uneven output's share of `grads`, from the step's tape.

        An output's share is its loss's gradient, times its loss weight and
        the optimizer's loss scale: in the units of `grads`.
        """
        outputs = []
        with step.tape.stop_recording():
            for output in uneven:
                factor = 1.0 if output.weight is None else float(output.weight)
                shares = step.tape.gradient(output.value, variables)
                outputs.append(OutputShare(
                    name=output.name, loss_weight=factor, count=output.count,
                    value=output.value,
                    grads=tuple(gradients.share_like(grad, share, factor, scale, variable)
                                for grad, share, variable in zip(grads, shares, variables))))
        return tuple(outputs)


def count_samples(data):
    """Number of samples in a micro-batch, as an int64 scalar tensor."""
    x, _, _ = _keras_on_tf.unpack_x_y_sample_weight(data)
    for leaf in tf.nest.flatten(x):
        if leaf is None:
            continue
        if isinstance(leaf, tf.SparseTensor):
            return tf.cast(leaf.dense_shape[0], tf.int64)
        if isinstance(leaf, tf.RaggedTensor):
            return _leading_size(leaf.row_splits) - 1
        return _leading_size(leaf)
    raise ValueError(
        "Cannot count the samples of a micro-batch: its inputs `x` hold no "
        f"tensor. Received: x={x!r}"
    )


def _leading_size(tensor):
    """`tensor`'s first dimension (int64), from a `Shape` op even where it is static.

    `tf.shape` and `nrows()` give a static size as a constant, which no op
    waits on: the counts' update must wait for the micro-batch's data, so
    that the step that finds none at the end of a dataset of unknown length
    counts nothing (TensorFlow's own folding of a static shape keeps that
    dependency).
    """
    return tf.raw_ops.Shape(input=tensor, out_type=tf.int64)[0]
