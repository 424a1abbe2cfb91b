"""What one micro-batch's loss is an average over: its samples, or its tokens.

Keras' default loss reduction (`"sum_over_batch_size"`) divides a loss by the
number of elements it averaged: every element, or only the unmasked ones
when a Keras mask reaches the loss (`Embedding(mask_zero=True)`, `Masking`,
`compute_mask`) or the loss masks labels itself (`ignore_class=`). A large
batch divides once by its total; so a window must weight each micro-batch by
that count, not by its samples, to be the large batch. This module finds the
count for Keras' compiled losses while the train step traces, and gives
custom steps and losses a way to say it themselves: `count_items()`.
"""

import collections
import contextlib
import threading
import warnings

import tensorflow as tf

from tfaccum import items as items_api
from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.patching import InstancePatch

_current = threading.local()  # the `ItemCount` of the step tracing in this thread


# One compiled loss as a step computed it: its output's name, its count (an
# int64 tensor, `None` where it cannot be known), whether that count is a
# fixed multiple of the samples, whether it is above 0 whenever the
# micro-batch holds a sample, the loss's value (a mean over its count) and
# its `loss_weights` entry (`None` for none).
CountedOutput = collections.namedtuple(
    "CountedOutput", "name count proportional positive value weight")


class ItemCount:
    """What the loss of the micro-step being traced averages over.

    `per_output` holds a `CountedOutput` per compiled loss. `explicit` is a
    count given with `count_items()`.
    """

    def __init__(self):
        self.per_output = []
        self.explicit = None
        self._said = []

    def say(self, items):
        """Takes the count given with `count_items()` (once per step)."""
        self._said.append(items)
        items_api.check_said_once(self._said)
        self.explicit = _checked_count(items)

    def uneven_outputs(self):
        """Outputs that need their own accumulator: several compiled losses,
        these averaging over counts that are no fixed multiple of the samples.
        Empty when one weight per micro-batch is exact."""
        if self.explicit is not None or len(self.per_output) < 2:
            return []
        return [output for output in self.per_output if not output.proportional]

    def resolve(self, samples, warn):
        """The micro-batch's weight in its window, as an int64 tensor, and
        whether it is above 0 in every micro-batch that holds a sample.

        An explicit count wins (it may be 0). One compiled loss: its count
        (above 0 for a fixed number of elements per sample; a mask or
        `ignore_class` may count 0). Several: the samples, exact when every
        loss averages over a fixed number of elements per sample; those that
        do not (`uneven_outputs()`) each need an accumulator of their own,
        which the hook adds.
        """
        if self.explicit is not None:
            return self.explicit, False
        if not self.per_output:
            return samples, True
        if len(self.per_output) == 1:
            output = self.per_output[0]
            if output.count is None:
                warn([output.name], "its loss does not say what it averages over")
                return samples, True
            return output.count, output.positive
        unknown = [output.name for output in self.uneven_outputs() if output.count is None]
        if unknown:
            warn(unknown, "its loss does not say what it averages over")
        return samples, True


MAX_ITEMS = items_api.MAX_ITEMS


def count_items(items):
    """TensorFlow's side of `tfaccum.count_items` (see it; a number was checked
    there): tells the step tracing in this thread. Another framework's tensor
    (a JAX model's loss, which a JAX step collects) is no business of this one's."""
    count = getattr(_current, "count", None)
    if count is not None and (tf.is_tensor(items) or not items_api.is_tensor(items)):
        count.say(items)
    return items


def _checked_count(items):
    """`items` as an int64 scalar tensor, checked while the step traces and runs."""
    if not tf.is_tensor(items):
        return tf.constant(int(items), tf.int64)
    dtype = tf.as_dtype(items.dtype)
    items_api.check_traced(
        items, dtype_name=dtype.name,
        is_number=(dtype.is_integer or dtype.is_floating) and dtype != tf.bool,
        shape=None if items.shape.rank is None else tuple(items.shape))
    value = tf.cast(items, tf.float64)
    passes = {"finite": tf.math.is_finite(value), "non_negative": value >= 0.0,
              "whole": tf.equal(tf.round(value), value), "at_most": value <= float(MAX_ITEMS)}
    asserts = [
        tf.debugging.Assert(passes[name], [f"`count_items()` takes what one micro-batch's loss "
                                           f"was divided by: {problem}. Received: items=", value])
        for name, problem in items_api.RUN_TIME_CHECKS
    ]
    with tf.control_dependencies(asserts):
        return tf.cast(tf.reshape(value, []), tf.int64)


class LossCounting:
    """Counts, while a model's train step traces, what each compiled loss averages over.

    While a step traces, Keras 3's compiled losses are wrapped: each wrapped
    loss computes exactly what it did, and records its count in the tracing
    thread's `ItemCount`. Without a distribution strategy Keras builds its
    compiled loss only when the first step traces: then the losses are
    wrapped as soon as they are built. Nothing is wrapped for models without
    a Keras 3 compiled loss (tf_keras, custom steps); `count_items()` works
    for all.
    """

    def __init__(self, model):
        self._compile_loss = _keras_on_tf.api_for(model).loss_container(model)
        self._lock = threading.Lock()
        self._depth = 0
        self._patches = []

    @contextlib.contextmanager
    def counting(self):
        """Yields the tracing step's `ItemCount`, filled as its loss is computed."""
        count = ItemCount()
        previous = getattr(_current, "count", None)
        _current.count = count
        with self._lock:
            if not self._depth:
                self._wrap()
            self._depth += 1
        try:
            yield count
        finally:
            _current.count = previous
            with self._lock:
                self._depth -= 1
                if not self._depth:
                    for patch in reversed(self._patches):
                        patch.restore()
                    self._patches = []

    def _wrap(self):
        container = self._compile_loss
        if container is None:
            return
        if _keras_on_tf.compiled_losses_of(container):
            self._wrap_losses()
            return
        build = container.build

        def build_then_wrap(*args, **kwargs):
            result = build(*args, **kwargs)
            if _keras_on_tf.compiled_losses_of(container):
                self._wrap_losses()
            return result

        self._apply(InstancePatch(container, "build", build_then_wrap))

    def _wrap_losses(self):
        container = self._compile_loss
        originals = _keras_on_tf.compiled_losses_of(container)
        attribute, wrapped = _keras_on_tf.wrapped_losses_patch(
            container, lambda name, loss, weight: _Counted(loss, name, weight)
        )
        self._apply(InstancePatch(container, attribute, wrapped))
        for _, loss in originals:
            if hasattr(loss, "call"):
                self._apply(InstancePatch(loss, "call", _capturing(loss)))

    def _apply(self, patch):
        patch.apply()
        self._patches.append(patch)


def _capturing(loss):
    """`loss.call` (as it is now), keeping what it returns for the tracing thread."""
    original = loss.call

    def call(*args, **kwargs):
        values = original(*args, **kwargs)
        _current.values = values
        return values

    return call


class _Counted:
    """A compiled loss that records its count, and computes what it did."""

    def __init__(self, loss, name, weight=None):
        self.loss = loss
        self.name = name or getattr(loss, "name", None) or repr(loss)
        self.weight = weight

    def __call__(self, y_true, y_pred, sample_weight=None):
        count = getattr(_current, "count", None)
        if count is None:  # not inside a counted trace
            return self.loss(y_true, y_pred, sample_weight)
        mask = _keras_on_tf.keras_mask(y_pred)
        _current.values = None
        value = self.loss(y_true, y_pred, sample_weight)
        divisor, proportional, positive = _keras_on_tf.loss_divisor(
            self.loss, _current.values, mask, sample_weight
        )
        count.per_output.append(
            CountedOutput(self.name, divisor, proportional, positive,
                          _keras_on_tf.as_in_total_loss(self.loss, value), self.weight))
        return value

    def __getattr__(self, name):
        return getattr(self.loss, name)


class OnceWarner:
    """Warns once per hook about micro-batches it cannot weight exactly."""

    def __init__(self):
        self.warned = False

    def __call__(self, names, reason):
        if self.warned:
            return
        self.warned = True
        warnings.warn(
            f"Gradient accumulation weights the micro-batches of {names} by "
            f"their samples, which is not exactly the large batch here: "
            f"{reason}. Call `tfaccum.count_items(n)` in the loss or train "
            "step with what one micro-batch's loss averages over to make it "
            "exact.",
            stacklevel=4,
        )


items_api.register(count_items)
