"""Keras 3's JAX trainer, as the JAX backend reads it (checked on Keras 3.7-3.15).

The JAX trainer runs `fit` on a state of plain arrays, `(trainable,
non-trainable, optimizer, metrics variables)`, passed through
`model.train_function(state, iterator)` batch by batch; the model's
variables are emptied while the loop holds the state and written back at
epoch ends (`jax_state_sync()`), or when a callback asks for it.
"""

import contextlib

import keras

from tfaccum._keras.models import flatten_layers
from tfaccum.patching import InstancePatch


def gradient_and_outputs(model, state, data):
    """The micro-batch's loss gradient, its loss and the state its forward pass left.

    `compute_loss_and_updates` is the trainer's stateless loss (public in
    Keras 3's JAX trainer, "intended for use with jax.grad").

    Returns:
        `(grads, unscaled_loss, y_pred, non_trainable, metrics, (x, y, sample_weight))`.
    """
    import jax

    trainable, non_trainable, optimizer_variables, metrics = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    gradient_of = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
    (_, aux), grads = gradient_of(
        trainable, non_trainable, metrics, x, y, sample_weight, training=True,
        optimizer_variables=optimizer_variables)
    unscaled_loss, y_pred, non_trainable, metrics = aux
    return grads, unscaled_loss, y_pred, non_trainable, metrics, (x, y, sample_weight)


def update_metrics(model, metrics, loss, data, y_pred):
    """Keras' logs of a step and its new metrics variables (private:
    `JAXTrainer._update_metrics_variables`, Keras 3.7-3.15)."""
    x, y, sample_weight = data
    return model._update_metrics_variables(metrics, loss, x, y, y_pred, sample_weight)


def state_of(model):
    """The trainer's state now, written back into the model's variables first."""
    sync(model)
    return ([v.value for v in model.trainable_variables],
            [v.value for v in model.optimizer.variables])


def sync(model):
    """Writes a running `fit`'s state back into the model's variables, so that
    the next step reads them (public: `JAXTrainer.jax_state_sync()`)."""
    model.jax_state_sync()


def restore(model, state):
    """Gives the model's variables the values of `state` again.

    The trainer empties them while a step holds the state (private:
    `JAXTrainer._purge_model_variables`, Keras 3.7-3.15); a step that fails
    before it returns a state would otherwise leave them empty.
    """
    trainable, non_trainable, optimizer_variables, metrics = state
    for variables, values in ((model.trainable_variables, trainable),
                              (model.non_trainable_variables, non_trainable),
                              (model.optimizer.variables, optimizer_variables),
                              (model.metrics_variables, metrics)):
        for variable, value in zip(variables, values):
            variable.assign(value)


def batch_size(data):
    """Samples in a micro-batch: the first dimension of its first input."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    first = next(leaf for leaf in keras.tree.flatten(x) if leaf is not None)
    return int(first.shape[0])


def distributed():
    """Whether a `keras.distribution` is set (several devices)."""
    return keras.distribution.distribution() is not None


@contextlib.contextmanager
def loss_inputs(model):
    """Notes, while a step traces, whether the outputs reaching `model.compute_loss`
    carry a Keras mask: `{"masked": bool}`.

    A mask rides on the traced outputs inside the gradient's trace only, so it
    is read where the loss receives them (private:
    `keras.src.backend.common.masking.get_keras_mask`, Keras 3.7-3.15).
    """
    from keras.src.backend.common.masking import get_keras_mask

    seen = {"masked": False}
    patch = InstancePatch(model, "compute_loss", None)

    def compute_loss(*args, **kwargs):
        y_pred = kwargs.get("y_pred", args[2] if len(args) > 2 else None)
        seen["masked"] = seen["masked"] or any(
            get_keras_mask(output) is not None for output in keras.tree.flatten(y_pred))
        return patch.original()(*args, **kwargs)

    patch.value = compute_loss
    patch.apply()
    try:
        yield seen
    finally:
        patch.restore()


def ignored_classes(model):
    """The compiled losses' `ignore_class` settings that are not `None` (public:
    the losses' `get_config()`)."""
    found = []
    for loss in keras.tree.flatten(getattr(model, "loss", None)):
        config = loss.get_config() if hasattr(loss, "get_config") else {}
        if config.get("ignore_class") is not None:
            found.append(f"{type(loss).__name__}(ignore_class={config['ignore_class']})")
    return found


def toolkit_parts(model):
    """tfaccum's own layers and losses in `model` (public: registered names, classes)."""
    layers = [layer.name for layer in flatten_layers(model)
              if keras.saving.get_registered_name(type(layer)).startswith("tfaccum>")]
    losses = [type(loss).__name__ for loss in keras.tree.flatten(getattr(model, "loss", None))
              if type(loss).__module__.startswith("tfaccum.")]
    return layers + losses
