"""What a compiled loss averages over: its container, losses, masks and divisors."""

import sys

import tensorflow as tf

from tfaccum._keras.models import compiled_losses_of
from tfaccum.backend.tensorflow._keras_on_tf.keras3_on_tf import api_for


# Reductions that divide by the number of (unmasked) elements; tf_keras'
# "auto" is "sum_over_batch_size" in `fit`.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "auto")


def may_hold_several_losses(model):
    """Whether `model`'s compiled loss may hold two or more per-output losses.

    Read from the built container where it is built, else from what
    `compile` received: several losses, or one loss (which tf_keras, and
    Keras 3 for some structures, repeat per output) on a model whose outputs
    are several or not known yet. Private: `CompileLoss._user_loss` (Keras
    3.7-3.16), `LossesContainer._user_losses` (tf_keras 2.16-2.21).
    """
    container = api_for(model).loss_container(model)
    if container is None:
        return False
    built = compiled_losses_of(container)
    if built is not None:
        return len(built) >= 2
    user = getattr(container, "_user_loss", getattr(container, "_user_losses", None))
    losses = [loss for loss in tf.nest.flatten(user) if loss is not None]
    if len(losses) >= 2:
        return True
    if not losses or tf.nest.is_nested(user):
        return False
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        outputs = None
    return outputs is None or len(tf.nest.flatten(outputs)) >= 2


def as_in_total_loss(loss, value):
    """`value`, what compiled `loss` returned, as the loss container adds it up.

    Under a strategy a loss averaged per batch is divided by the number of
    replicas: Keras 3 does it inside the loss's call, tf_keras' container
    after it.
    """
    tf_keras = sys.modules.get("tf_keras")
    if (
        tf_keras is not None
        and isinstance(loss, tf_keras.losses.Loss)
        and loss.reduction in ("auto", "sum_over_batch_size")
    ):
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:
            return value * (1.0 / replicas)
    return value


def keras_mask(x):
    """The Keras mask a tensor carries (`_keras_mask`), or `None`."""
    return getattr(x, "_keras_mask", None)


def loss_divisor(loss, values, mask, sample_weight):
    """What Keras divides `loss` by, whether that is a fixed multiple of the samples, and
    whether it is above 0 in every micro-batch with a sample.

    `values` are the per-element losses `loss.call` returned (they may carry
    a mask of their own, as `ignore_class` does) and `mask` the one `y_pred`
    carried. Under `"sum_over_batch_size"` (and `"mean"`) Keras divides by
    the number of unmasked elements (`keras.losses.Loss.__call__`, 3.7-3.16).
    Returns `(None, False, False)` where it does not divide by a count
    (`"sum"`, `"mean_with_sample_weight"`, no reduction) or `values` is unknown.
    """
    reduction = getattr(loss, "reduction", None)
    if values is None or reduction not in _MEAN_REDUCTIONS:
        return None, False, False
    own = keras_mask(values)
    if own is not None:
        mask = own if mask is None else tf.logical_and(tf.cast(mask, tf.bool), tf.cast(own, tf.bool))
    if mask is not None:
        return tf.cast(tf.reduce_sum(tf.cast(mask, tf.int64)), tf.int64), False, False
    values = tf.convert_to_tensor(values)  # a loss may return a Python number
    shape = values.shape
    size = tf.size(values, out_type=tf.int64)
    if sample_weight is not None:
        # As `reduce_weighted_values` lines the weights up with the losses.
        # Private: `keras.src.losses.loss.squeeze_or_expand_to_same_rank`
        # (Keras 3.7-3.16).
        from keras.src.losses.loss import squeeze_or_expand_to_same_rank

        values, weights = squeeze_or_expand_to_same_rank(
            values, tf.cast(sample_weight, values.dtype)
        )
        if values.shape.rank != weights.shape.rank or values.shape != weights.shape:
            shape = tf.broadcast_static_shape(values.shape, weights.shape)
            size = tf.reduce_prod(
                tf.broadcast_dynamic_shape(
                    tf.shape(values, out_type=tf.int64), tf.shape(weights, out_type=tf.int64)
                )
            )
    proportional = shape.rank is not None and (
        shape.rank == 0 or shape[1:].is_fully_defined()
    )
    # A scalar counts 1; otherwise a fixed number of elements per sample.
    positive = proportional and (shape.rank == 0 or shape[1:].num_elements() > 0)
    return size, proportional, positive
