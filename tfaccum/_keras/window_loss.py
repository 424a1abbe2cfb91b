"""Gradient caching's view of Keras: seed generators, the compiled loss, its tracker."""

import tensorflow as tf

from tfaccum._keras.api import flatten_layers
from tfaccum._keras.api import is_tf_keras_model


def seed_states(model):
    """The state variables of the seed generators `model`'s layers draw from.

    A Keras 3 layer that draws random numbers (`Dropout`, `GaussianNoise`,
    ...) draws them from a `SeedGenerator` whose state moves at every draw:
    set back, a forward pass draws the same masks again. Private:
    `Layer._seed_generators` and `SeedGenerator.state` (Keras 3.7-3.15).
    tf_keras has none (see `random_layers`).
    """
    if is_tf_keras_model(model):
        return []
    states, seen = [], set()
    for layer in [model] + flatten_layers(model):
        for generator in getattr(layer, "_seed_generators", ()):
            state = generator.state
            if id(state) not in seen:
                seen.add(id(state))
                states.append(state)
    return states


def global_seed_state():
    """The state of Keras' global seed generator, made now if it is not yet.

    `keras.random.*` called without a seed draws from it (and moves it):
    set back, a forward pass draws the same numbers again. Made eagerly
    here so that no step makes it while it traces. Private:
    `keras.src.random.seed_generator.global_seed_generator` (Keras 3.7-3.15).
    """
    from keras.src.random.seed_generator import global_seed_generator

    with tf.init_scope():
        return global_seed_generator().state


def random_layers(model):
    """Names of `model`'s tf_keras layers that draw random numbers ([] on Keras 3).

    tf_keras' `BaseRandomLayer`s draw from stateful random ops (or a
    generator) whose masks a second forward pass cannot draw again.
    Private: `tf_keras.src.engine.base_layer.BaseRandomLayer` (2.16-2.21).
    """
    if not is_tf_keras_model(model):
        return []
    from tf_keras.src.engine.base_layer import BaseRandomLayer

    return [layer.name for layer in flatten_layers(model) if isinstance(layer, BaseRandomLayer)]


def has_compiled_metrics(model):
    """Whether `compile` was given (non-empty) `metrics=` or `weighted_metrics=`.

    Private: the metrics container (`_compile_metrics`, Keras 3.7-3.15;
    `compiled_metrics`, tf_keras 2.16-2.21) and what it kept of `compile`'s
    arguments (`_user_metrics`, `_user_weighted_metrics`).
    """
    container = getattr(model, "_compile_metrics", None)
    if container is None and is_tf_keras_model(model):
        container = getattr(model, "compiled_metrics", None)
    if container is None:
        return False
    return any(metric is not None
               for name in ("_user_metrics", "_user_weighted_metrics")
               for metric in tf.nest.flatten(getattr(container, name, None)))


def computes_loss_as_keras(model):
    """Whether `model`'s class keeps Keras' own `compute_loss` (no override)."""
    for cls in type(model).__mro__:
        if "compute_loss" in vars(cls):
            return cls.__module__.split(".")[0] in ("keras", "tf_keras")
    return True


def compiled_loss(model, y, y_pred, sample_weight):
    """The compiled loss of a whole window.

    Keras 3: `Trainer._compute_loss` (private, 3.7-3.15), which divides by
    the replicas under a strategy and updates no metric (`track_loss` does).
    tf_keras: `Model.compute_loss` (public), whose compiled loss also
    updates its own loss metric, as the large batch's step does.
    """
    if is_tf_keras_model(model):
        return model.compute_loss(None, y, y_pred, sample_weight)
    return model._compute_loss(x=None, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=True)


def track_loss(model, loss, samples):
    """Adds a window's loss to the logs' `loss`, weighted by its samples (this replica's).

    Keras 3: the loss tracker (`Trainer._loss_tracker`, private, 3.7-3.15),
    as its own train step updates it; tf_keras' compiled loss updated its
    metric when `compiled_loss` computed it.
    """
    if is_tf_keras_model(model):
        return
    model._loss_tracker.update_state(loss, sample_weight=samples)


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
