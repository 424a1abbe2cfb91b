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


def gradient_and_outputs(model, state, data, staging=None):
    """The micro-batch's loss gradient, its loss and the state its forward pass left.

    `compute_loss_and_updates` is the trainer's stateless loss (public in
    Keras 3's JAX trainer, "intended for use with jax.grad").

    Args:
        staging: A context manager giving a list that layers append
            `(layer, *arrays)` to while the forward pass traces, or `None`:
            the arrays leave the gradient as its auxiliary output.

    Returns:
        `(grads, unscaled_loss, y_pred, non_trainable, metrics, (x, y, sample_weight),
        staged)`, `staged` `{layer: [arrays of each call]}`.
    """
    import jax

    trainable, non_trainable, optimizer_variables, metrics = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    layers = []

    def loss(*args, **kwargs):
        if staging is None:
            loss, aux = model.compute_loss_and_updates(*args, **kwargs)
            return loss, (aux, [])
        with staging() as staged:
            loss, aux = model.compute_loss_and_updates(*args, **kwargs)
        layers[:] = [entry[0] for entry in staged]  # Python objects: not traced out
        return loss, (aux, [entry[1:] for entry in staged])

    (_, (aux, arrays)), grads = jax.value_and_grad(loss, has_aux=True)(
        trainable, non_trainable, metrics, x, y, sample_weight, training=True,
        optimizer_variables=optimizer_variables)
    unscaled_loss, y_pred, non_trainable, metrics = aux
    staged = {}
    for layer, values in zip(layers, arrays):
        staged.setdefault(layer, []).append(values)
    return grads, unscaled_loss, y_pred, non_trainable, metrics, (x, y, sample_weight), staged


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


def publish(model, state):
    """Makes `state` the one `fit` writes back into the variables if it stops now.

    Keras' JAX `fit` writes its last step's state (private: `_jax_state`,
    Keras 3.7-3.15) into the variables in its `finally`; between a step that
    donated the state and Keras' own assignment of its outputs, an interrupt
    would have it write deleted arrays. The hook publishes each completed
    step's state itself, and the state it was given before any step runs.
    """
    trainable, non_trainable, optimizer_variables, metrics = state
    model._jax_state = {"trainable_variables": trainable,
                        "non_trainable_variables": non_trainable,
                        "optimizer_variables": optimizer_variables,
                        "metrics_variables": metrics}


def write_published(model):
    """Writes the published state into the variables now (an interrupt is on its
    way out through code that may not: Keras' `train_on_batch`)."""
    if getattr(model, "_jax_state", None):
        # Where a handler does not raise, the loop goes on as it was: with
        # the state it holds, or reading the variables.
        synced = getattr(model, "_jax_state_synced", True)
        model._jax_state_synced = False
        model.jax_state_sync()
        model._jax_state_synced = synced


def republish(model):
    """Publishes the variables' state in place of a running `fit`'s (after the hook
    assigned them new arrays and donated the old: a flush)."""
    if getattr(model, "_jax_state", None):
        publish(model, [[v.value for v in variables] for variables in state_variables(model)])


def restore(model, state):
    """Gives the model's variables the values of `state` again, for good.

    The trainer empties them while a step holds the state (private:
    `JAXTrainer._purge_model_variables`, Keras 3.7-3.15); a step that fails
    before it returns a state would otherwise leave them empty, or `fit`'s
    end would write back the state of the batch before, whose arrays the
    failed step was given (private: `_jax_state_synced`, the same versions).
    """
    for variables, values in zip(state_variables(model), state):
        for variable, value in zip(variables, values):
            variable.assign(value)
    model._jax_state_synced = True


def state_variables(model):
    """The variables of the trainer's state, in its order."""
    return (model.trainable_variables, model.non_trainable_variables,
            model.optimizer.variables, model.metrics_variables)


def loss_scale_positions(optimizer):
    """Where a `LossScaleOptimizer`'s `dynamic_scale` and `step_counter` are in
    its `variables` (public attributes), or `None` for another optimizer."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    variables = list(optimizer.variables)
    index = next(i for i, v in enumerate(variables) if v is optimizer.dynamic_scale)
    return index, next(i for i, v in enumerate(variables) if v is optimizer.step_counter)


def iterations_position(optimizer):
    """Where `optimizer.iterations` is in its `variables` (public)."""
    return next(i for i, v in enumerate(optimizer.variables) if v is optimizer.iterations)


def batch_size(data):
    """Samples in a micro-batch: the first dimension of its first input."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    first = next(leaf for leaf in keras.tree.flatten(x) if leaf is not None)
    return int(first.shape[0])


def distribution():
    """The `keras.distribution` set now, or `None` (public)."""
    return keras.distribution.distribution()


def data_parallel(distribution):
    """Whether `distribution` is `keras.distribution.DataParallel` (public)."""
    return isinstance(distribution, keras.distribution.DataParallel)


def batch_norm_layers(model):
    """The names of `model`'s `BatchNormalization` layers (public classes)."""
    return [layer.name for layer in flatten_layers(model)
            if isinstance(layer, keras.layers.BatchNormalization)]


def offset_seeds(model, non_trainable, offset):
    """`non_trainable` with every random seed moved by `offset` (a device's
    index), so that each device draws its own dropout masks. A
    `keras.random.SeedGenerator` keeps `[seed, counter]` in a variable named
    `seed_generator_state` (public: its `state`)."""
    return [value.at[0].add(offset.astype(value.dtype))
            if variable.name == "seed_generator_state" else value
            for variable, value in zip(model.non_trainable_variables, non_trainable)]


@contextlib.contextmanager
def loss_inputs(model):
    """While a step traces, what the compiled loss averages over:
    `{"items": int tensor or None}`.

    Where a Keras mask rides on the output or the loss has an `ignore_class`,
    Keras divides the loss by the elements left (`losses.loss.apply_mask`):
    `items` counts them; `None` where neither reaches the loss (it averages
    over the samples). A mask rides on the traced outputs inside the
    gradient's trace only, so it is read where `compute_loss` receives them
    (`keras_mask`). The count depends on the data only, not on the weights.
    """
    import jax.numpy as jnp

    seen = {"items": None}
    patch = InstancePatch(model, "compute_loss", None)
    ignore = ignore_class(model)

    def compute_loss(*args, **kwargs):
        y = kwargs.get("y", args[1] if len(args) > 1 else None)
        y_pred = kwargs.get("y_pred", args[2] if len(args) > 2 else None)
        outputs = keras.tree.flatten(y_pred)
        masks = [keras_mask(output) for output in outputs]
        if any(mask is not None for mask in masks) or ignore is not None:
            if len(outputs) > 1:
                raise ValueError(
                    "tfaccum on Keras' JAX backend counts the items of one output's "
                    f"masked loss, not yet of {len(outputs)} outputs' (reduction='auto'). "
                    "Use reduction=\"samples\" if their losses average per sample, or "
                    "KERAS_BACKEND=tensorflow, where each output counts its own.")
            valid = None if masks[0] is None else masks[0].astype(bool)
            if ignore is not None:
                kept = keras.tree.flatten(y)[0] != ignore
                kept = kept.reshape(valid.shape) if valid is not None else kept
                valid = kept if valid is None else valid & kept
            seen["items"] = jnp.sum(valid.astype(jnp.int32))
        return patch.original()(*args, **kwargs)

    patch.value = compute_loss
    patch.apply()
    try:
        yield seen
    finally:
        patch.restore()


def ignore_class(model):
    """The compiled loss's `ignore_class`, or `None` (public: `get_config()`)."""
    found = [loss.get_config().get("ignore_class")
             for loss in keras.tree.flatten(getattr(model, "loss", None))
             if hasattr(loss, "get_config")]
    found = [value for value in found if value is not None]
    return found[0] if found else None


def toolkit_layers(model):
    """`(name, layer)` of tfaccum's own layers in `model`: a class of tfaccum's among
    each one's bases (`convert_batch_norm`'s layers carry Keras' name and module)."""
    return [(layer.name, layer) for layer in flatten_layers(model)
            if any(cls.__module__.startswith("tfaccum.") for cls in type(layer).__mro__)]


def own_train_step(model):
    """The class that overrides Keras' JAX `train_step`, or `None` (private:
    `keras.src.backend.jax.trainer.JAXTrainer`, Keras 3.7-3.15)."""
    from keras.src.backend.jax.trainer import JAXTrainer

    for cls in type(model).__mro__:
        if cls is JAXTrainer:
            return None
        if "train_step" in vars(cls):
            return cls.__name__
    return None


def training_arguments(model):
    """`{"training": True}` where the model's `call` takes it, as Keras' JAX
    trainer passes it (private: `Layer._call_has_training_arg`, Keras 3.7-3.15)."""
    return {"training": True} if model._call_has_training_arg else {}


def metrics_logs(model, metrics):
    """Keras' logs of `metrics` (the metrics variables' values), as a step returns
    them (public: `get_metrics_result()`, read in a stateless scope)."""
    with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, metrics))):
        return model.get_metrics_result()


def keras_mask(tensor):
    """The Keras mask riding on a traced output, or `None` (private:
    `keras.src.backend.common.masking.get_keras_mask`, Keras 3.7-3.15)."""
    from keras.src.backend.common.masking import get_keras_mask

    return get_keras_mask(tensor)
