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


def optimizer_variables(optimizer):
    """The variables a built optimizer tracks, for `apply(grads)` without them.

    Private: `Optimizer._trainable_variables` (Keras 3.5-3.16).
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


def fit_arguments(model):
    """The arguments of the running `model.fit` (`{name: value}`), or `{}`.

    The `fit` frame's locals, as `fit_is_running` finds it: a callback sees
    neither the data nor `shuffle`. Their names are Keras' public signature
    (`x`, `shuffle`, `steps_per_epoch`; Keras 3.7-3.16).
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
                return dict(frame.f_locals)
            frame = frame.f_back
        return {}
    finally:
        del frame


def variable_numpy(variable):
    """A Keras 3 variable's value as a NumPy array, on any backend (on
    TensorFlow read from the variable itself: a mirrored one too)."""
    value = variable.value
    if keras.backend.backend() == "tensorflow":
        return value.numpy()
    return keras.ops.convert_to_numpy(value)


def build_compiled_metrics(model, data):
    """Makes the compiled metrics' variables, as the first step would, from a
    batch `data` (`Trainer._symbolic_build(data_batch=)`, private, Keras
    3.7-3.16; TensorFlow on one device makes them while its first step
    traces, the other backends before `fit`'s first step)."""
    model._symbolic_build(data_batch=data)


def resume_at_epoch(model, epoch):
    """Makes the running `fit` start at `epoch` (as Keras' `BackupAndRestore`
    does: `Trainer._initial_epoch`, private, read once `on_train_begin` ran;
    Keras 3.7-3.16)."""
    model._initial_epoch = epoch


def fit_callback_list(callback):
    """The `CallbackList` of the running `fit` that holds `callback`, or `None`.

    Called from a callback's `on_train_begin`: walks up the frames to the
    `CallbackList` (Keras 3's or tf_keras') calling it. Neither Keras gives a
    callback its siblings; the list and its `callbacks` attribute are public
    (Keras 3.7-3.16, tf_keras 2.16-2.21).
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


def overriding_class(model, base, method):
    """The name of the class between `type(model)` and `base` (a backend's
    Keras trainer) that overrides `method`, or `None`."""
    for cls in type(model).__mro__:
        if cls is base:
            return None
        if method in vars(cls):
            return cls.__name__
    return None


def flatten_layers(model):
    """Every layer nested in `model`, at any depth (not `model` itself).

    Private: `Layer._flatten_layers` (Keras 3.5-3.16, tf_keras 2.16-2.21).
    """
    return list(model._flatten_layers(include_self=False, recursive=True))


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


def metrics_given(container):
    """Whether a compiled metrics container kept non-empty `metrics=` or
    `weighted_metrics=` (`_user_metrics`, `_user_weighted_metrics`: private,
    Keras 3.7-3.16 and tf_keras 2.16-2.21)."""
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


def computes_loss_as_keras(model):
    """Whether `model`'s class keeps Keras' own `compute_loss` (no override), on
    either Keras and any backend."""
    for cls in type(model).__mro__:
        if "compute_loss" in vars(cls):
            return cls.__module__.split(".")[0] in ("keras", "tf_keras")
    return True


def compiled_losses_of(container):
    """`[(output name, loss)]` of a built container, else `None`.

    Private: `CompileLoss._flat_losses`, namedtuples `(path, loss,
    loss_weights, name)` (Keras 3.7-3.16); `LossesContainer._losses` and
    `_output_names`, `_built` (tf_keras 2.16-2.21; `None` for an output
    without a loss).
    """
    entries = getattr(container, "_flat_losses", None)
    if entries:
        return [(entry[3], entry[1]) for entry in entries]
    if getattr(container, "_built", False) and getattr(container, "_losses", None):
        names = list(getattr(container, "_output_names", None) or [])
        names += [None] * (len(container._losses) - len(names))
        return [(name, loss) for name, loss in zip(names, container._losses) if loss is not None]
    return None


def wrapped_losses_patch(container, wrap):
    """An `(attribute, value)` that replaces each compiled loss with `wrap(name, loss, weight)`.

    `weight` is the loss's `loss_weights` entry (`None` for none). Private:
    `LossesContainer._loss_weights` (tf_keras 2.16-2.21, a flat list once built).
    """
    entries = getattr(container, "_flat_losses", None)
    if entries:
        return "_flat_losses", [
            entry._replace(**{entry._fields[1]: wrap(entry[3], entry[1], entry[2])})
            for entry in entries
        ]
    names = list(getattr(container, "_output_names", None) or [])
    names += [None] * (len(container._losses) - len(names))
    weights = list(getattr(container, "_loss_weights", None) or [])
    weights += [None] * (len(container._losses) - len(weights))
    return "_losses", [
        None if loss is None else wrap(name, loss, weight)
        for name, loss, weight in zip(names, container._losses, weights)
    ]


def batch_norm_moments(layer, inputs, mask):
    """Per-batch mean and variance, as `BatchNormalization` computes them.

    Private: `BatchNormalization._moments(inputs, mask)` (Keras 3.5-3.16).
    """
    return layer._moments(inputs, mask)


def batch_norm_reduction_axes(layer):
    """The axes `BatchNormalization` reduces over (set when it is built).

    Private: `BatchNormalization._reduction_axes` (Keras 3.5-3.16).
    """
    return layer._reduction_axes


def training_arguments(model):
    """`{"training": True}` where the model's `call` takes it, as Keras' own step
    passes it (`{}` where it does not).

    Private: `Layer._call_has_training_arg` (Keras 3.7-3.16, tf_keras 2.16-2.21).
    """
    return {"training": True} if getattr(model, "_call_has_training_arg", True) else {}


def compiled_loss(model, y, y_pred, sample_weight, x=None):
    """The compiled loss, as Keras 3's `train_step` computes it (under a strategy
    divided by the replicas; no metric updated).

    Private: `Trainer._compute_loss` (Keras 3.7-3.16).
    """
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=True)


def track_loss(model, loss, samples):
    """Adds `loss` to the logs' `loss`, weighted by `samples`, as Keras 3's own step
    updates its tracker.

    Private: `Trainer._loss_tracker` (Keras 3.7-3.16).
    """
    model._loss_tracker.update_state(loss, sample_weight=samples)
