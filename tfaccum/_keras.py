"""The one place that knows which Keras is in use.

Everything Keras-version specific lives here so that the accumulation logic
in `hook.py` and `callback.py` is shared.
"""

import keras
import tensorflow as tf

Callback = keras.callbacks.Callback
unpack_x_y_sample_weight = keras.utils.unpack_x_y_sample_weight


def print_msg(message):
    """Prints like Keras' own callbacks: to stdout, or to absl logging."""
    if keras.config.is_interactive_logging_enabled():
        print(message, flush=True)
    else:
        import absl.logging

        absl.logging.info(message)


def built_in_accumulation_steps(optimizer):
    """Keras' own `gradient_accumulation_steps` of `optimizer`, or `None`.

    Looks through `LossScaleOptimizer` to the optimizer it wraps.
    """
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    inner = getattr(optimizer, "inner_optimizer", None)
    if not steps and inner is not None:
        steps = getattr(inner, "gradient_accumulation_steps", None)
    return steps or None


def scales_loss_dynamically(optimizer):
    """Whether `optimizer` is a `LossScaleOptimizer` (mixed precision)."""
    return getattr(optimizer, "inner_optimizer", None) is not None


def loss_scale(optimizer):
    """What `optimizer.scale_loss()` multiplies the loss (and gradients) by now.

    A float32 tensor read when called, or `None` when it does not scale.
    """
    if scales_loss_dynamically(optimizer):
        return tf.cast(optimizer.dynamic_scale.value, tf.float32)
    factor = getattr(optimizer, "loss_scale_factor", None)
    return None if factor is None else tf.constant(factor, tf.float32)


def is_compiled(model):
    return bool(getattr(model, "compiled", False)) and (
        getattr(model, "optimizer", None) is not None
    )
