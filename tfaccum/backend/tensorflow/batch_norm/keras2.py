"""`AccumBatchNormalization` for Keras 2 (tf_keras).

`tfaccum.AccumBatchNormalization` is a Keras 3 layer; tf_keras models use
this one, which behaves the same way: each micro-batch is normalised with its
own statistics, and the moving statistics move once per optimizer update,
from the window's samples pooled exactly. `tfaccum.convert_batch_norm` uses it
for tf_keras models.

Example:

```python
import tf_keras
from tfaccum.backend.tensorflow.batch_norm.keras2 import AccumBatchNormalization

model = tf_keras.Sequential([
    tf_keras.Input((32, 32, 3)),
    tf_keras.layers.Conv2D(16, 3),
    AccumBatchNormalization(),
    tf_keras.layers.ReLU(),
])
```
"""

import tensorflow as tf
import tf_keras

from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.batch_norm_conversion import saved_as
from tfaccum.backend.tensorflow.batch_norm.moments import WindowedMoments


@tf_keras.saving.register_keras_serializable(package="tfaccum")
class AccumBatchNormalization(WindowedMoments, tf_keras.layers.BatchNormalization):
    """tf_keras' `BatchNormalization` whose moving statistics see the whole window.

    A drop-in for `tf_keras.layers.BatchNormalization` (same arguments,
    defaults, weights and `get_config`; exactly that layer without gradient
    accumulation). Under accumulation its moving statistics equal those of
    `BatchNormalization` at the large batch, fused or not (the fused kernel,
    tf_keras' default for 4D inputs, moves towards the unbiased variance: so
    does this layer then). With `synchronized=True` on several replicas the
    statistics are pooled over all of them. `renorm`, `virtual_batch_size`
    and `adjustment` are refused under accumulation.
    """

    def call(self, inputs, training=None, mask=None):
        pooled = self._pooled
        training = tf.get_static_value(_keras_on_tf.tf_keras_training_value(self, training))
        if pooled is None or not training:
            return super().call(inputs, training=training, mask=mask)
        inputs = tf.cast(inputs, self.compute_dtype)
        x = tf.cast(inputs, tf.float32) if inputs.dtype in (tf.float16, tf.bfloat16) else inputs
        ndims = len(x.shape)
        axes = [i for i in range(ndims) if i not in self.axis]
        if self._synchronizes(mask):
            share, (_, mean, variance) = self._synchronized_moments(x, axes)
        else:
            mean, variance = _keras_on_tf.tf_keras_batch_norm_moments(self, x, axes, mask)
            share = (self._sample_count(x, mask, axes), mean, variance)
        pooled.stage(*share)
        shape = [1] * ndims
        for axis in self.axis:
            shape[axis] = x.shape[axis]

        def broadcast(value):
            return None if value is None else tf.reshape(tf.cast(value, x.dtype), shape)

        outputs = tf.nn.batch_normalization(
            x, broadcast(mean), broadcast(variance), broadcast(self.beta),
            broadcast(self.gamma), self.epsilon)
        return tf.cast(outputs, inputs.dtype)

    def _new_pooled(self, strategy):
        unsupported = [name for name in ("renorm", "virtual_batch_size", "adjustment")
                       if getattr(self, name, None)]
        if unsupported:
            name = unsupported[0]
            raise ValueError(
                f"Layer {self.name!r}: AccumBatchNormalization with `{name}` is "
                "not supported under gradient accumulation. Received: "
                f"{name}={getattr(self, name)!r}"
            )
        return super()._new_pooled(strategy)

    def _window_variance(self, variance, count):
        if not self.fused:
            return variance
        # The fused kernel's moving variance is the unbiased one.
        return variance * count / tf.maximum(count - 1.0, 1.0)


class ConvertedBatchNormalization(AccumBatchNormalization):
    """What `convert_batch_norm` makes of a tf_keras `BatchNormalization`: saved as one."""


saved_as(ConvertedBatchNormalization, tf_keras.layers.BatchNormalization)


def conversion():
    """What `convert_batch_norm` converts a tf_keras model with: the class it
    converts, the class it makes, and how it copies a model."""
    return (tf_keras.layers.BatchNormalization, ConvertedBatchNormalization,
            tf_keras.models.load_model)
