"""Keras 3 (`keras`, `tf.keras` in TensorFlow 2.16+): every way it differs from tf_keras.

`api_for(model)` hands this class (or `tf_keras.TfKeras`) to whoever needs a
difference; nothing outside the two asks which Keras a model belongs to.
"""

import keras

from tfaccum._keras.models import compiled_with_optimizer
from tfaccum._keras.models import metrics_given
from tfaccum._keras.models import regularized_variables


class Keras3:
    """Keras 3 (`keras`, `tf.keras` in TensorFlow 2.16+), as every backend reads it.

    What only the TensorFlow backend reads of it (the optimizer's `apply`
    and `scale_loss`, loss scaling, compiled losses, seeds) is
    `tfaccum.backend.tensorflow._keras_on_tf.Keras3OnTf`, a subclass.
    """

    @staticmethod
    def is_compiled(model):
        return compiled_with_optimizer(model, "compiled")


    @staticmethod
    def steps_per_execution(model):
        return int(model.steps_per_execution)


    @staticmethod
    def built_in_accumulation_steps(optimizer):
        """Keras' own `gradient_accumulation_steps` of `optimizer`, or `None`.

        Looks through `LossScaleOptimizer` to the optimizer it wraps.
        """
        steps = getattr(optimizer, "gradient_accumulation_steps", None)
        inner = getattr(optimizer, "inner_optimizer", None)
        if not steps and inner is not None:
            steps = getattr(inner, "gradient_accumulation_steps", None)
        return steps or None


    @staticmethod
    def loss_container(model):
        """The object holding the compiled losses (`Trainer._compile_loss`, a
        `CompileLoss`, private, 3.7-3.16), or `None`. Built (its losses resolved
        per output) before `fit`'s first step on JAX and under a TensorFlow
        strategy, else while the first step traces."""
        return getattr(model, "_compile_loss", None)


    @staticmethod
    def has_compiled_metrics(model):
        """Whether `compile` was given `metrics=` or `weighted_metrics=`
        (`Trainer._compile_metrics`, private, 3.7-3.16)."""
        return metrics_given(getattr(model, "_compile_metrics", None))


    @staticmethod
    def backend():
        """The backend this Keras runs on."""
        return keras.backend.backend()


    @staticmethod
    def regularized_weights(model):
        """Names of the trainable weights that carry a weight regularizer
        (`Variable.regularizer`, public, 3.7-3.16)."""
        return regularized_variables(model)
