"""Gradient caching's view of Keras' step, alike on both versions (the rest:
`Keras3OnTf`, `TfKeras`)."""

from tfaccum._keras import models


def scaled_loss(optimizer, loss):
    """`loss` times the optimizer's loss scale (mixed precision), else `loss`."""
    if hasattr(optimizer, "scale_loss"):  # Keras 3
        return optimizer.scale_loss(loss)
    if hasattr(optimizer, "get_scaled_loss"):  # tf_keras' LossScaleOptimizer
        return optimizer.get_scaled_loss(loss)
    return loss


def metrics_result(model):
    """The logs a train step returns (`Model.get_metrics_result`, public on both)."""
    return model.get_metrics_result()


def training_forward(model, x):
    """`model(x)` in training mode, as Keras' own step calls it
    (`tfaccum._keras.models.training_arguments`)."""
    return model(x, **models.training_arguments(model))
