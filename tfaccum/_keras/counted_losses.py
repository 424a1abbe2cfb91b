"""What each compiled loss averaged over, read while Keras computes it (every backend
whose step computes the loss itself: JAX, PyTorch).

`loss_inputs(model)` wraps the compiled losses while `compute_loss` runs;
each records its value and its count (`CountedOutput`), computed with
`keras.ops` on the backend's tensors (traced on JAX, eager on PyTorch).
"""

import collections
import contextlib

from keras import ops

from tfaccum._keras.keras3 import Keras3
from tfaccum._keras.models import compiled_losses_of
from tfaccum._keras.models import wrapped_losses_patch
from tfaccum.patching import InstancePatch


# One compiled loss as a step traced it: its output's name, its `loss_weights`
# entry (`None` for none), its value (a mean) and what it averaged over (an
# int32 count, or `None` where it averages over the samples).
CountedOutput = collections.namedtuple("CountedOutput", "name weight value count")


@contextlib.contextmanager
def loss_inputs(model):
    """While a step traces, what the compiled losses average over:
    `{"items": int tensor or None, "outputs": [CountedOutput]}`.

    Each compiled loss (`_flat_losses`, Keras 3.7-3.16) is wrapped while
    `compute_loss` runs: it computes what it did and records its value and
    count in `outputs`. Where a Keras mask rides on its output or it has an
    `ignore_class`, Keras divides the loss by the elements left
    (`losses.loss.apply_mask`): the count is theirs; else `None` (it
    averages over the samples). One compiled loss gives its count as `items`;
    several leave `items` `None` (the step weighs the rest by samples and takes
    apart those with a count). A mask rides on the traced outputs inside the
    gradient's trace only, so it is read where the loss receives them. The
    counts depend on the data only, not on the weights.
    """
    seen = {"items": None, "outputs": []}
    patch = InstancePatch(model, "compute_loss", None)

    def compute_loss(*args, **kwargs):
        container = Keras3.loss_container(model)
        if container is None or not compiled_losses_of(container):
            return patch.original()(*args, **kwargs)
        records = []
        attribute, wrapped = wrapped_losses_patch(
            container, lambda name, loss, weight: _CountedLoss(loss, name, weight, records))
        losses = InstancePatch(container, attribute, wrapped)
        losses.apply()
        try:
            result = patch.original()(*args, **kwargs)
        finally:
            losses.restore()
        seen["outputs"] = records
        seen["items"] = records[0].count if len(records) == 1 else None
        return result

    patch.value = compute_loss
    patch.apply()
    try:
        yield seen
    finally:
        patch.restore()


# Reductions that divide by the number of (unmasked) elements (as TensorFlow's
# `loss_divisor` reads them); under another a loss counts the samples.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "auto")


class _CountedLoss:
    """A compiled loss that records its value and count, and computes what it did."""

    def __init__(self, loss, name, weight, records):
        self.loss, self.name, self.weight, self.records = loss, name, weight, records
        self.divides = getattr(loss, "reduction", None) in _MEAN_REDUCTIONS
        self.ignore = ignore_class(loss)

    def __call__(self, y_true, y_pred, sample_weight=None):
        value = self.loss(y_true, y_pred, sample_weight)
        mask, ignore = keras_mask(y_pred), self.ignore
        count = None
        if self.divides and (mask is not None or ignore is not None):
            valid = None if mask is None else ops.cast(mask, "bool")
            if ignore is not None:
                kept = ops.not_equal(y_true, ignore)
                kept = ops.reshape(kept, ops.shape(valid)) if valid is not None else kept
                valid = kept if valid is None else ops.logical_and(valid, kept)
            count = ops.sum(ops.cast(valid, "int32"))
        self.records.append(CountedOutput(self.name, self.weight, value, count))
        return value

    def __getattr__(self, name):
        return getattr(self.loss, name)


def ignore_class(loss):
    """A compiled loss's `ignore_class`, or `None`: Keras' own losses' attribute, or
    what a function's wrapper passes it (private: `LossFunctionWrapper._fn_kwargs`,
    Keras 3.7-3.16). Not `get_config()`: a wrapped `functools.partial` or lambda
    cannot be serialised."""
    found = getattr(loss, "ignore_class", None)
    return found if found is not None else (getattr(loss, "_fn_kwargs", None) or {}).get(
        "ignore_class")


def keras_mask(tensor):
    """The Keras mask riding on a traced output, or `None` (private:
    `keras.src.backend.common.masking.get_keras_mask`, Keras 3.7-3.16)."""
    from keras.src.backend.common.masking import get_keras_mask

    return get_keras_mask(tensor)
