"""What only the TensorFlow backend reads of a Keras model, alike on both Kerases:
its step (Keras' own or an override), what it compiled with, its embedding
tables, every variable its training may change and the optimizers it holds.
"""

from tfaccum._keras.models import flatten_layers


def trains_with_keras_step(model):
    """Whether `model`'s class keeps Keras' own `train_step` (no override).

    Such a step applies `model.trainable_variables`, so their optimizer
    variables and accumulators can be made before it traces. A `train_step`
    set on the instance is an override too.
    """
    if "train_step" in vars(model):
        return False
    for cls in type(model).__mro__:
        if "train_step" in vars(cls):
            return cls.__module__.split(".")[0] in ("keras", "tf_keras")
    return False


def compile_config(model):
    """What `model.compile()` was last given, to notice a recompile.

    Private: `Model._compile_config` (Keras 3.5-3.16, tf_keras 2.16-2.21);
    `None` where absent.
    """
    return getattr(model, "_compile_config", None)


def embedding_tables(model):
    """The trainable tables of `model`'s Embedding layers (Keras 3 or tf_keras).

    What a train step usually gives sparse (`IndexedSlices`) gradients: a
    table looked up with `gather`. Subclasses count (keras_hub's
    `ReversibleEmbedding`, whose tied table may get a dense one instead).
    """
    tables = []
    for layer in flatten_layers(model):
        is_embedding = any(cls.__name__ == "Embedding"
                           and cls.__module__.split(".")[0] in ("keras", "tf_keras")
                           for cls in type(layer).__mro__)
        table = getattr(layer, "embeddings", None)
        if is_embedding and table is not None and layer.trainable:
            tables.append(table)
    return tables


def forget_traced_functions(model):
    """Makes Keras trace `model`'s train/test/predict functions again at their next use.

    Private: the `*_function` attributes `make_*_function` caches (Keras 3.5-3.16).
    """
    model.train_function = None
    model.test_function = None
    model.predict_function = None


def stateful_variables(model):
    """Every variable `model`'s training may change: weights, seed generators,
    metrics, and the variables of each optimizer the model holds as an attribute
    (`model.optimizer`, a GAN's `d_optimizer`, ...).

    Public on both: `Model.variables`, `Model.metrics` and their `variables`,
    an optimizer's `variables` (a property in Keras 3, a method in tf_keras).
    """
    found, seen = [], set()

    def add(variables):
        for variable in variables() if callable(variables) else variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                found.append(variable)

    add(model.variables)
    for metric in getattr(model, "metrics", ()):
        add(metric.variables)
    holders = [model.optimizer] + list(vars(model).values())
    for value in holders:
        if _is_optimizer(value):
            add(value.variables)
    return found


def other_optimizers(model):
    """`(attribute, optimizer)` for each optimizer `model` holds besides its own.

    A GAN's `compile(d_optimizer=..., g_optimizer=...)` keeps them as
    attributes (public: instance attributes of the user's model).
    """
    own = model.optimizer
    inner = getattr(own, "inner_optimizer", None)
    return [(name, value) for name, value in vars(model).items()
            if _is_optimizer(value) and value is not own and value is not inner]


def _is_optimizer(value):
    return (value is not None and not isinstance(value, type)
            and callable(getattr(value, "apply_gradients", None))
            and hasattr(type(value), "iterations"))  # (asking an instance may make it)
