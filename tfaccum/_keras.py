"""The one place that knows which Keras a model belongs to.

tfaccum serves Keras 3 (`keras`, `tf.keras` in TensorFlow 2.16+) and Keras 2
(`tf_keras`, or `tf.keras` with `TF_USE_LEGACY_KERAS=1`) from one
implementation: `hook.py` and `callback.py` ask `api_for(model)` for the few
things the two do differently. `tf_keras` is never imported here; a model can
only be a `tf_keras` model once its user has imported it.
"""

import sys

import keras
import tensorflow as tf


class Callback(keras.callbacks.Callback):
    """Keras 3's `Callback`, also speaking `tf_keras`' `CallbackList` protocol."""

    # Our hooks read no logs: tf_keras need not copy them to the host per batch.
    _supports_tf_logs = True

    def _implements_train_batch_hooks(self):
        return True

    def _implements_test_batch_hooks(self):
        return False

    def _implements_predict_batch_hooks(self):
        return False


unpack_x_y_sample_weight = keras.utils.unpack_x_y_sample_weight


def print_msg(message):
    """Prints like Keras' own callbacks: to stdout, or to absl logging."""
    if keras.config.is_interactive_logging_enabled():
        print(message, flush=True)
    else:
        import absl.logging

        absl.logging.info(message)


def is_tf_keras_model(model):
    tf_keras = sys.modules.get("tf_keras")
    return tf_keras is not None and isinstance(model, tf_keras.Model)


class Keras3:
    """Keras 3: `train_step` calls `optimizer.scale_loss()` and `optimizer.apply()`."""

    # The optimizer method a train step hands its gradients to.
    apply_method = "apply"
    # Whether the sample weighting can ride on `optimizer.scale_loss()`.
    scales_loss_in_step = True

    @staticmethod
    def is_compiled(model):
        return _compiled_with_optimizer(model, "compiled")

    @staticmethod
    def steps_per_execution(model):
        return int(model.steps_per_execution)

    @staticmethod
    def apply_arguments(grads, trainable_variables=None):
        """`(grads, variables)` from the patched `apply`'s arguments."""
        return list(grads), trainable_variables

    @staticmethod
    def apply(optimizer, grads, variables):
        type(optimizer).apply(optimizer, grads, variables)

    @staticmethod
    def build_optimizer(optimizer, variables):
        if not optimizer.built:
            optimizer.build(variables)
            optimizer.built = True

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
    def loss_scale(optimizer):
        """What the gradients the optimizer receives are multiplied by now.

        A float32 tensor read when called, or `None` when they are not scaled.
        """
        if scales_loss_dynamically(optimizer):
            return tf.cast(optimizer.dynamic_scale.value, tf.float32)
        factor = getattr(optimizer, "loss_scale_factor", None)
        return None if factor is None else tf.constant(factor, tf.float32)

    @staticmethod
    def lower_loss_scale(optimizer):
        """Halves a dynamic loss scale after a non-finite step, as Keras does.

        Returns the factor to multiply the (scaled) accumulated gradients by.
        """
        optimizer.step_counter.assign(0)
        optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)
        return 0.5


class TfKeras:
    """Keras 2 (`tf_keras`): `train_step` calls `optimizer.minimize()`.

    `minimize()` computes the gradients (unscaled again under mixed precision)
    and passes them to `apply_gradients()`, which also all-reduces them across
    replicas.
    """

    apply_method = "apply_gradients"
    scales_loss_in_step = False

    @staticmethod
    def is_compiled(model):
        return _compiled_with_optimizer(model, "_is_compiled")

    @staticmethod
    def steps_per_execution(model):
        steps = getattr(model, "_steps_per_execution", None)
        return 1 if steps is None else int(steps.numpy())

    @staticmethod
    def apply_arguments(grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs):
        if skip_gradients_aggregation or not kwargs.get(
            "experimental_aggregate_gradients", True
        ):
            raise ValueError(
                "Gradient accumulation all-reduces the window's gradients "
                "once, when it is applied; it cannot take gradients the "
                "train step already aggregated. Received: "
                "optimizer.apply_gradients(..., skip_gradients_aggregation="
                f"{skip_gradients_aggregation}, **{kwargs})"
            )
        pairs = list(grads_and_vars)
        return [g for g, _ in pairs], [v for _, v in pairs]

    @staticmethod
    def apply(optimizer, grads, variables):
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        type(optimizer).apply_gradients(optimizer, pairs)

    @staticmethod
    def build_optimizer(optimizer, variables):
        optimizer.build(variables)  # a no-op once built

    @staticmethod
    def built_in_accumulation_steps(optimizer):
        return None  # tf_keras optimizers have none

    @staticmethod
    def loss_scale(optimizer):
        return None  # `minimize()` hands over unscaled gradients

    @staticmethod
    def lower_loss_scale(optimizer):
        if not optimizer.dynamic:
            return None
        state = optimizer._loss_scale  # as its `apply_gradients` does
        state.counter.assign(0)
        state.current_loss_scale.assign(
            tf.maximum(state.current_loss_scale / state.multiplier, 1.0)
        )
        return None  # the window holds unscaled gradients: keep it


def _compiled_with_optimizer(model, flag):
    return bool(getattr(model, flag, False)) and (
        getattr(model, "optimizer", None) is not None
    )


def api_for(model):
    """`Keras3` or `TfKeras`: what `model` was built with."""
    return TfKeras if is_tf_keras_model(model) else Keras3


def scales_loss_dynamically(optimizer):
    """Whether `optimizer` is a `LossScaleOptimizer` (mixed precision)."""
    return getattr(optimizer, "inner_optimizer", None) is not None
