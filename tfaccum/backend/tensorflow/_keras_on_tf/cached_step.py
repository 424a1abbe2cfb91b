"""Gradient caching's view of Keras' step, alike on both versions (the rest:
`Keras3OnTf`, `TfKeras`)."""


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
    """`model(x)` in training mode, as Keras' own step calls it.

    Private: `Layer._call_has_training_arg` (Keras 3.7-3.15, tf_keras
    2.16-2.21): a model whose `call` takes no `training` is called without.
    """
    if getattr(model, "_call_has_training_arg", True):
        return model(x, training=True)
    return model(x)
