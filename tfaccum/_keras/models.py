"""What tfaccum reads of a Keras model, its optimizers and its `fit`, alike on both Kerases.

Where Keras 3 and tf_keras differ, `keras3.Keras3` and `tf_keras.TfKeras`
answer; what is here asks no version.
"""

import inspect
import sys

import keras


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


def is_model(value):
    """Whether `value` trains like a Keras model (Keras 3 or tf_keras).

    Duck-typed: a `keras.Model`, or anything else with a `train_step` and
    `make_train_function` (Keras' own tests mix its trainer into layers).
    """
    if isinstance(value, keras.Model):
        return True
    return callable(getattr(value, "make_train_function", None)) and callable(
        getattr(value, "train_step", None)
    )


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


# Keras 3's backends tfaccum accumulates on (tf_keras is TensorFlow's alone).


def compile_config(model):
    """What `model.compile()` was last given, to notice a recompile.

    Private: `Model._compile_config` (Keras 3.5-3.15, tf_keras 2.16-2.21);
    `None` where absent.
    """
    return getattr(model, "_compile_config", None)


def optimizer_variables(optimizer):
    """The variables a built optimizer tracks, for `apply(grads)` without them.

    Private: `Optimizer._trainable_variables` (Keras 3.5-3.15).
    """
    return optimizer._trainable_variables


def fit_is_running(model):
    """Whether `model.fit` is on the call stack (called from one of its callbacks).

    Looks for a frame of a function named `fit` whose `self` is `model`;
    Keras 3 and tf_keras both run their callbacks from inside `fit`.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
                return True
            frame = frame.f_back
        return False
    finally:
        del frame


def fit_callback_list(callback):
    """The `CallbackList` of the running `fit` that holds `callback`, or `None`.

    Called from a callback's `on_train_begin`: walks up the frames to the
    `CallbackList` (Keras 3's or tf_keras') calling it. Neither Keras gives a
    callback its siblings; the list and its `callbacks` attribute are public
    (Keras 3.7-3.15, tf_keras 2.16-2.21).
    """
    classes = [keras.callbacks.CallbackList]
    tf_keras = sys.modules.get("tf_keras")
    if tf_keras is not None:
        classes.append(tf_keras.callbacks.CallbackList)
    frame = inspect.currentframe()
    try:
        for _ in range(16):
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, tuple(classes)) and any(c is callback for c in owner.callbacks):
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame


def orbax_checkpoint_class():
    """`keras.callbacks.OrbaxCheckpoint` (Keras 3.14+), or `None`."""
    return getattr(keras.callbacks, "OrbaxCheckpoint", None)


def flatten_layers(model):
    """Every layer nested in `model`, at any depth (not `model` itself).

    Private: `Layer._flatten_layers` (Keras 3.5-3.15, tf_keras 2.16-2.21).
    """
    return list(model._flatten_layers(include_self=False, recursive=True))


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

    Private: the `*_function` attributes `make_*_function` caches (Keras 3.5-3.15).
    """
    model.train_function = None
    model.test_function = None
    model.predict_function = None


def compiled_with_optimizer(model, flag):
    return bool(getattr(model, flag, False)) and (
        getattr(model, "optimizer", None) is not None
    )


def iterations(optimizer):
    """The variable counting `optimizer`'s updates, as learning-rate schedules read it.

    Keras 3 before 3.9 gives `LossScaleOptimizer` an `iterations` of its own
    that never moves (its inner optimizer counts); from 3.9 on it is the
    inner optimizer's. The inner one is right on every version.
    """
    inner = getattr(optimizer, "inner_optimizer", None)
    return (inner if inner is not None else optimizer).iterations


def scales_loss_dynamically(optimizer):
    """Whether `optimizer` is a `LossScaleOptimizer` (mixed precision)."""
    return getattr(optimizer, "inner_optimizer", None) is not None


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


def metrics_given(container):
    """Whether a compiled metrics container kept non-empty `metrics=` or
    `weighted_metrics=` (`_user_metrics`, `_user_weighted_metrics`: private,
    Keras 3.7-3.15 and tf_keras 2.16-2.21)."""
    if container is None:
        return False
    return any(_holds_something(getattr(container, name, None))
               for name in ("_user_metrics", "_user_weighted_metrics"))


def _holds_something(given):
    """Whether a nest of lists, tuples and dicts (Keras' tracking wrappers
    are their subclasses) holds anything but `None`."""
    if isinstance(given, dict):
        return any(_holds_something(value) for value in given.values())
    if isinstance(given, (list, tuple)):
        return any(_holds_something(value) for value in given)
    return given is not None


def regularized_variables(model):
    """Paths of `model`'s trainable variables that carry a regularizer (public)."""
    return [getattr(v, "path", v.name) for v in model.trainable_variables
            if getattr(v, "regularizer", None) is not None]
