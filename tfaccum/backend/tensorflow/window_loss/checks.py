"""What a window-wide loss cannot meet on TensorFlow, refused by name.

The losses are the core's (`tfaccum.window_losses`); so are the refusals every
backend shares. These are TensorFlow's own: strategies, tf_keras, XLA.
"""

from tfaccum import window_losses
from tfaccum.backend.tensorflow import _keras_on_tf


def check_window_loss_meets(model, loss, configuration):
    """Refuses, by name, what a window-wide loss (gradient caching) cannot meet yet.

    `configuration`: the hook's `Configuration` (its reduction, accumulators,
    observers).

    Everything accepted is exact: the window's update is the large batch's.
    """
    def refuse(what, why, fix):  # as the core's (`window_losses.check_meets`)
        raise ValueError(
            f"Model {model.name!r} is compiled with the window-wide loss {loss!r}, "
            f"which cannot meet {what}: {why}. {fix}")

    strategy = model.distribute_strategy
    replicas = strategy.num_replicas_in_sync
    if replicas > 1 and len(strategy.extended.worker_devices) < replicas:
        refuse(f"a strategy across several machines ({type(strategy).__name__})",
               "the window's outputs are gathered across one machine's replicas only",
               "Train it on one machine (MirroredStrategy), or compile with an ordinary loss.")
    api = _keras_on_tf.api_for(model)
    if replicas > 1 and not api.gathers_across_replicas:
        refuse(f"a tf_keras model under a strategy with {replicas} replicas",
               "gathering the window's outputs across replicas is built for Keras 3 only",
               "Use Keras 3, or one device.")
    if model.jit_compile and _keras_on_tf.trains_with_keras_step(model):
        refuse("jit_compile=True (which Keras 3's default, \"auto\", picks on a GPU)",
               "the window's buffers grow with each micro-batch, which XLA's fixed shapes "
               "do not allow", "Compile with jit_compile=False.")
    if replicas > 1 and _keras_on_tf.may_hold_several_losses(model):
        refuse(f"several compiled losses under a strategy with {replicas} replicas",
               "the window's loss is taken whole and Keras' per-replica share undone for "
               "it as one averaged loss", "Compile one loss, or train on one device.")
    random = api.random_layers(model)
    if random:
        refuse(f"tf_keras layers that draw random numbers ({random})",
               "their masks cannot be drawn again for the second forward pass",
               "Use Keras 3 (its seed generators replay), or remove them.")
    if not api.caches_under_loss_scaling and _keras_on_tf.scales_loss_dynamically(model.optimizer):
        refuse("tf_keras' LossScaleOptimizer", "mixed precision is built for Keras 3 only",
               "Use Keras 3, or float32.")
    norms = [layer.name for layer in _keras_on_tf.flatten_layers(model)
             if any("BatchNormalization" in cls.__name__ for cls in type(layer).__mro__)]
    window_losses.check_meets(
        model, loss, configuration, keras_step=_keras_on_tf.trains_with_keras_step(model),
        keras_compute_loss=_keras_on_tf.computes_loss_as_keras(model),
        compiled_metrics=api.has_compiled_metrics(model), batch_norm=norms)
