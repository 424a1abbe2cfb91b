"""What `AccumBatchNormalization` reads of Keras' BatchNormalization (both Kerases)."""

import tensorflow as tf

# Keras 3's, read alike on every backend.
from tfaccum._keras.models import batch_norm_moments  # noqa: F401
from tfaccum._keras.models import batch_norm_reduction_axes  # noqa: F401


def tf_keras_training_value(layer, training):
    """What tf_keras' `BatchNormalization` takes `training` to be (False if frozen).

    Private: `BatchNormalizationBase._get_training_value` (tf_keras 2.16-2.21).
    """
    return layer._get_training_value(training)


def tf_keras_batch_norm_moments(layer, inputs, axes, mask):
    """tf_keras' `BatchNormalization` moments over `axes` (masked if `mask`).

    Private: `BatchNormalizationBase._moments` and `_param_dtype` (tf_keras 2.16-2.21).
    """
    return layer._moments(tf.cast(inputs, layer._param_dtype), axes, keep_dims=False, mask=mask)


def batch_norm_renorm(layer):
    """Whether the layer uses batch renormalization.

    `renorm` exists on Keras 3.14+ (and on tf_keras); earlier Keras 3
    releases (3.5-3.13) have no renormalization: `False` there.
    """
    return bool(getattr(layer, "renorm", False))


# -- what a compiled loss averages over ---------------------------------------
