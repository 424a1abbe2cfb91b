"""Keras 3's JAX trainer, as the JAX backend reads it (checked on Keras 3.7-3.16).

The JAX trainer runs `fit` on a state of plain arrays, `(trainable,
non-trainable, optimizer, metrics variables)`, passed through
`model.train_function(state, iterator)` batch by batch; the model's
variables are emptied while the loop holds the state and written back at
epoch ends (`jax_state_sync()`), or when a callback asks for it.
"""


import keras

from tfaccum._keras import models
from tfaccum._keras import private
from tfaccum._keras.models import flatten_layers

# Keras' JAX trainer class: `Trainer` from 3.16, `JAXTrainer` in 3.7-3.15.
TRAINER = private.module_attribute("keras.src.backend.jax.trainer", "Trainer", "JAXTrainer")
# From 3.16, a `train_function` with `steps_per_execution > 1` is handed one
# "super batch" (its batches stacked along a new first axis), or the list of
# an epoch's last, fewer ones; in 3.7-3.15 it pulls each batch itself.
PARTIAL_BATCHES = private.optional_attribute(
    "keras.src.trainers.data_adapters.data_adapter_utils", "PartialBatchList")
STACKS_EXECUTIONS = PARTIAL_BATCHES is not None


def execution_batches(iterator, steps_per_execution, one_batch=False):
    """The micro-batches of one `train_function(state, iterator)` call, one by
    one (a generator: it ends where the data does); `one_batch`: the call is
    `train_on_batch`'s, whose iterator holds one plain batch on every Keras."""
    if not STACKS_EXECUTIONS or steps_per_execution == 1 or one_batch:
        for _ in range(steps_per_execution):
            try:
                yield next(iterator)
            except StopIteration:
                return
        return
    try:
        data = next(iterator)
    except StopIteration:
        return
    if isinstance(data, PARTIAL_BATCHES):
        yield from data
        return
    steps = int(next(leaf for leaf in keras.tree.flatten(data) if leaf is not None).shape[0])
    for i in range(steps):
        yield keras.tree.map_structure(lambda leaf: None if leaf is None else leaf[i], data)


def gradient_and_outputs(model, state, data, staging=None, apart=None):
    """The micro-batch's loss gradient, its loss and the state its forward pass left.

    `compute_loss_and_updates` is the trainer's stateless loss (public in
    Keras 3's JAX trainer, "intended for use with jax.grad").

    Args:
        staging: A context manager giving a list that layers append
            `(layer, *arrays)` to while the forward pass traces, or `None`:
            the arrays leave the gradient as its auxiliary output.
        apart: `(seen, names, factors)`, or `None`: the compiled losses
            whose gradients are taken apart (`loss_inputs`' `seen`, their
            outputs' names, and what each one's gradient is multiplied by:
            its loss weight times the loss scale). One forward pass, a
            backward pass for each and one for the rest (`jax.vjp`).

    Returns:
        `(grads, unscaled_loss, y_pred, non_trainable, metrics, (x, y, sample_weight),
        staged, outputs)`, `staged` `{layer: [arrays of each call]}`, `outputs`
        `[(grads, value, count)]` of each output taken apart (its gradient
        times its factor, its loss and count), `grads` then the rest's.
    """
    import jax
    import jax.numpy as jnp

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

    rest = (non_trainable, metrics, x, y, sample_weight)
    kwargs = dict(training=True, optimizer_variables=optimizer_variables)
    outputs = []
    if apart is None:
        (_, (aux, arrays)), grads = jax.value_and_grad(loss, has_aux=True)(
            trainable, *rest, **kwargs)
    else:
        seen, names, factors = apart

        def with_outputs(trainable):
            total, extra = loss(trainable, *rest, **kwargs)
            found = [output for output in seen["outputs"] if output.count is not None]
            if [output.name for output in found] != list(names):
                raise ValueError(
                    f"The outputs whose losses count differently changed between "
                    f"traces: {list(names)} then {[output.name for output in found]}.")
            values = jnp.stack([jnp.asarray(output.value, total.dtype) for output in found])
            return (total, values), (extra, [output.count for output in found])

        (total, values), backward, ((aux, arrays), counts) = jax.vjp(
            with_outputs, trainable, has_aux=True)
        factors = jnp.stack([jnp.asarray(f, total.dtype) for f in factors])
        # Linear in the cotangent: the rest is the whole minus each output's share.
        grads = backward((jnp.ones_like(total), -factors))[0]
        for i, count in enumerate(counts):
            share = backward((jnp.zeros_like(total), factors * jax.nn.one_hot(
                i, len(counts), dtype=total.dtype)))[0]
            outputs.append((share, values[i], count))
    unscaled_loss, y_pred, non_trainable, metrics = aux
    staged = {}
    for layer, values in zip(layers, arrays):
        staged.setdefault(layer, []).append(values)
    return (grads, unscaled_loss, y_pred, non_trainable, metrics, (x, y, sample_weight), staged,
            outputs)


def update_metrics(model, metrics, loss, data, y_pred):
    """Keras' logs of a step and its new metrics variables (private:
    the JAX trainer's `_update_metrics_variables`, Keras 3.7-3.16)."""
    x, y, sample_weight = data
    return model._update_metrics_variables(metrics, loss, x, y, y_pred, sample_weight)


def state_of(model):
    """The trainer's state now, written back into the model's variables first."""
    sync(model)
    return ([v.value for v in model.trainable_variables],
            [v.value for v in model.optimizer.variables])


def sync(model):
    """Writes a running `fit`'s state back into the model's variables, so that
    the next step reads them (public: the JAX trainer's `jax_state_sync()`)."""
    model.jax_state_sync()


def publish(model, state):
    """Makes `state` the one `fit` writes back into the variables if it stops now.

    Keras' JAX `fit` writes its last step's state (private: `_jax_state`,
    Keras 3.7-3.16) into the variables in its `finally`; between a step that
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
    the JAX trainer's `_purge_model_variables`, Keras 3.7-3.16); a step that fails
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


def toolkit_layers(model):
    """`(name, layer)` of tfaccum's own layers in `model`: a class of tfaccum's among
    each one's bases (`convert_batch_norm`'s layers carry Keras' name and module)."""
    return [(layer.name, layer) for layer in flatten_layers(model)
            if any(cls.__module__.startswith("tfaccum.") for cls in type(layer).__mro__)]


def own_train_step(model):
    """The class that overrides Keras' JAX `train_step`, or `None` (`TRAINER`)."""
    return models.overriding_class(model, TRAINER, "train_step")


def metrics_logs(model, metrics):
    """Keras' logs of `metrics` (the metrics variables' values), as a step returns
    them (public: `get_metrics_result()`, read in a stateless scope)."""
    with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, metrics))):
        return model.get_metrics_result()
