"""`AccumBatchNormalization`: batch statistics that see the whole window (Keras 3)."""

import keras
from keras import ops

from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow.batch_norm.moments import WindowedMoments
from tfaccum.batch_norm_conversion import saved_as


class AccumBatchNormalization(WindowedMoments, keras.layers.BatchNormalization):
    """`BatchNormalization` whose moving statistics see the whole accumulation window.

    A drop-in for `keras.layers.BatchNormalization`: the same arguments,
    defaults, weights and `get_config`. Without gradient accumulation it is
    exactly `BatchNormalization`. While `GradientAccumulationCallback` (or an
    `AccumulationHook`) trains the model, each micro-batch is still normalised
    with its own statistics, but `moving_mean` and `moving_variance` are
    updated once per optimizer update, with `momentum` applied once, from the
    mean and variance of all samples of the window pooled exactly (within-
    plus between-micro-batch variance). So after accumulated training the
    moving statistics are those `BatchNormalization` would have at the large
    batch. A dropped window (`leftover="drop"`) leaves them untouched.

    Plain `BatchNormalization` under accumulation updates its statistics from
    each small micro-batch (keras-team/keras#16633).

    With several replicas and `synchronized=True`, each forward pass's
    statistics are taken over every replica (one all-reduce, as the Keras
    layer does) and the moving statistics equal single-device
    `BatchNormalization` at the global large batch. With
    `synchronized=False` each replica pools its own share of the window, as
    `BatchNormalization` keeps each replica's share of a batch. `renorm=True`
    is not supported under accumulation (a clear error says so).

    Example:

    ```python
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(16, 3),
        tfaccum.AccumBatchNormalization(),
        keras.layers.ReLU(),
    ])
    ```
    """

    def call(self, inputs, training=None, mask=None):
        pooled = self._pooled
        if pooled is None or not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            return super().call(inputs, training=training, mask=mask)  # its error
        # BatchNormalization's training branch, with the moving statistics
        # left to the end of the window.
        inputs = ops.cast(inputs, keras.backend.result_type(inputs.dtype, "float32"))
        axes = _keras_on_tf.batch_norm_reduction_axes(self)
        if self._synchronizes(mask):
            share, (_, mean, variance) = self._synchronized_moments(inputs, axes)
        else:
            mean, variance = _keras_on_tf.batch_norm_moments(self, inputs, mask)
            share = (self._sample_count(inputs, mask, axes), mean, variance)
        pooled.stage(*share)
        gamma = ops.cast(self.gamma, inputs.dtype) if self.scale else None
        beta = ops.cast(self.beta, inputs.dtype) if self.center else None
        outputs = ops.batch_normalization(
            x=inputs,
            mean=mean,
            variance=variance,
            axis=self.axis,
            offset=beta,
            scale=gamma,
            epsilon=self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)



# Saved as "tfaccum>AccumBatchNormalization", the name JAX's layer is saved under
# too: registered where Keras runs on TensorFlow only, so that a model loads with
# the layer of the backend that loads it (this module imported on JAX, as a
# test does, does not take the name from JAX's).
if keras.backend.backend() == "tensorflow":
    keras.saving.register_keras_serializable(package="tfaccum")(AccumBatchNormalization)


class ConvertedBatchNormalization(AccumBatchNormalization):
    """What `convert_batch_norm` makes of a `BatchNormalization`: saved as one
    (`tfaccum.batch_norm_conversion.saved_as`)."""


saved_as(ConvertedBatchNormalization, keras.layers.BatchNormalization)
