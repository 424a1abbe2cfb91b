"""Keras 3 and tf_keras: the API objects that own their differences, and the model's own.

`api_for(model)` gives `Keras3` or `TfKeras`; the functions beside them read
a compiled model, its optimizers and the running `fit`.
"""

import contextlib
import inspect
import os
import sys

import keras
import tensorflow as tf


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


class Keras3:
    """Keras 3: `train_step` calls `optimizer.scale_loss()` and `optimizer.apply()`."""

    # The optimizer method a train step hands its gradients to.
    apply_method = "apply"
    # Whether the sample weighting can ride on `optimizer.scale_loss()`.
    scales_loss_in_step = True
    # The optimizer method the step's loss passes through.
    loss_method = "scale_loss"

    @staticmethod
    def is_compiled(model):
        return _compiled_with_optimizer(model, "compiled")

    @staticmethod
    def steps_per_execution(model):
        return int(model.steps_per_execution)

    @staticmethod
    def apply_arguments(grads, trainable_variables=None):
        """`(grads, variables)` from the patched `apply`'s arguments."""
        return list(grads), trainable_variables

    @staticmethod
    def apply(apply, grads, variables, reduced=False):
        """Calls `apply`, the optimizer's own (unpatched) `apply` method.

        `reduced`: the gradients are already summed over replicas
        (`all_reduce_sum`), inside `own_reduction_off`.
        """
        apply(grads, variables)

    @staticmethod
    @contextlib.contextmanager
    def own_reduction_off(optimizer):
        """Switches off the optimizer's all-reduce, in the cross-replica context.

        Keras 3 clips each replica's gradients before summing them; reduced
        by `all_reduce_sum` first, they are clipped as on one device, and
        cross devices once. Private: `_all_reduce_sum_gradients` of the
        TensorFlow optimizer (Keras 3.7-3.15).
        """
        target = getattr(optimizer, "inner_optimizer", None) or optimizer
        if not hasattr(target, "_all_reduce_sum_gradients"):
            raise RuntimeError(
                "This Keras version's optimizer has no `_all_reduce_sum_gradients`; "
                "tfaccum cannot apply a window across replicas with it. Received: "
                f"{type(target).__name__} from Keras {keras.__version__}"
            )
        target.__dict__["_all_reduce_sum_gradients"] = list
        try:
            yield
        finally:
            del target.__dict__["_all_reduce_sum_gradients"]

    @staticmethod
    def build_optimizer(optimizer, variables):
        if not optimizer.built:
            optimizer.build(variables)
            optimizer.built = True

    @staticmethod
    def built_in_accumulation_steps(optimizer):
        """Keras' own `gradient_accumulation_steps` of `optimizer`, or `None`.

        Looks through `LossScaleOptimizer` to the optimizer it wraps.
        """
        steps = getattr(optimizer, "gradient_accumulation_steps", None)
        inner = getattr(optimizer, "inner_optimizer", None)
        if not steps and inner is not None:
            steps = getattr(inner, "gradient_accumulation_steps", None)
        return steps or None

    @staticmethod
    def loss_scale(optimizer):
        """What the gradients the optimizer receives are multiplied by now.

        A float32 tensor read when called, or `None` when they are not scaled.
        """
        if scales_loss_dynamically(optimizer):
            return tf.cast(optimizer.dynamic_scale.value, tf.float32)
        factor = getattr(optimizer, "loss_scale_factor", None)
        return None if factor is None else tf.constant(factor, tf.float32)

    @staticmethod
    def count_skipped_update(optimizer):
        """A skipped (all non-finite) update is not counted in Keras 3."""

    @staticmethod
    def lower_loss_scale(optimizer):
        """Halves a dynamic loss scale after a non-finite step, as Keras does.

        Returns the factor to multiply the (scaled) accumulated gradients by.
        """
        optimizer.step_counter.assign(0)
        optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)
        return 0.5


class TfKeras:
    """Keras 2 (`tf_keras`): `train_step` calls `optimizer.minimize()`.

    `minimize()` computes the gradients (unscaled again under mixed precision)
    and passes them to `apply_gradients()`, which also all-reduces them across
    replicas.
    """

    apply_method = "apply_gradients"
    scales_loss_in_step = False
    loss_method = "minimize"

    @staticmethod
    def is_compiled(model):
        # Private: `Model._is_compiled` (tf_keras 2.16-2.21).
        return _compiled_with_optimizer(model, "_is_compiled")

    @staticmethod
    def steps_per_execution(model):
        # Private: `Model._steps_per_execution` (tf_keras 2.16-2.21).
        steps = getattr(model, "_steps_per_execution", None)
        return 1 if steps is None else int(steps.numpy())

    @staticmethod
    def apply_arguments(grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs):
        if skip_gradients_aggregation or not kwargs.get(
            "experimental_aggregate_gradients", True
        ):
            raise ValueError(
                "Gradient accumulation all-reduces the window's gradients "
                "once, when it is applied; it cannot take gradients the "
                "train step already aggregated. Received: "
                "optimizer.apply_gradients(..., skip_gradients_aggregation="
                f"{skip_gradients_aggregation}, **{kwargs})"
            )
        pairs = list(grads_and_vars)
        return [g for g, _ in pairs], [v for _, v in pairs]

    @staticmethod
    def apply(apply_gradients, grads, variables, reduced=False):
        """Calls `apply_gradients`, the optimizer's own (unpatched) method.

        `reduced`: the gradients are already summed over replicas; its own
        aggregation is then switched off by its public argument (new
        optimizers take it as a keyword too).
        """
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if reduced:
            apply_gradients(pairs, experimental_aggregate_gradients=False)
        else:
            apply_gradients(pairs)

    @staticmethod
    def own_reduction_off(optimizer):
        """Nothing to switch off: `apply(..., reduced=True)` says it by argument."""
        return contextlib.nullcontext()

    @staticmethod
    def build_optimizer(optimizer, variables):
        """Creates the optimizer's variables now, outside the update's branch."""
        if hasattr(optimizer, "build"):
            optimizer.build(variables)  # a no-op once built
        else:
            # A legacy optimizer (`tf_keras.optimizers.legacy.*`, or a
            # LossScaleOptimizer over one) has no `build`; private:
            # `OptimizerV2._create_all_weights` (tf_keras 2.16-2.21) makes
            # its iterations, hyperparameters and slots, as its own
            # `apply_gradients` would on the first call.
            optimizer._create_all_weights(variables)

    @staticmethod
    def built_in_accumulation_steps(optimizer):
        return None  # tf_keras optimizers have none

    @staticmethod
    def loss_scale(optimizer):
        return None  # `minimize()` hands over unscaled gradients

    @staticmethod
    def count_skipped_update(optimizer):
        """tf_keras' LossScaleOptimizer counts a step it skips in `iterations`."""
        if scales_loss_dynamically(optimizer):
            optimizer.iterations.assign_add(1)

    @staticmethod
    def lower_loss_scale(optimizer):
        if not optimizer.dynamic:
            return None
        # Private: `LossScaleOptimizer._loss_scale` (tf_keras 2.16-2.21), as
        # its own `apply_gradients` does.
        state = optimizer._loss_scale
        state.counter.assign(0)
        state.current_loss_scale.assign(
            tf.maximum(state.current_loss_scale / state.multiplier, 1.0)
        )
        return None  # the window holds unscaled gradients: keep it


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


SUPPORTED_BACKENDS = ("tensorflow",)


def check_backend(model=None):
    """Raises unless Keras 3 runs on a backend tfaccum serves (public: `keras.backend.backend()`).

    Without a `model` (a callback made before `fit`), a user of tf_keras,
    which runs on TensorFlow whatever Keras 3's backend, is not refused.
    """
    if model is not None and is_tf_keras_model(model):
        return
    backend = keras.backend.backend()
    if backend in SUPPORTED_BACKENDS or (model is None and "tf_keras" in sys.modules):
        return
    raise ValueError(
        f"tfaccum accumulates gradients on Keras 3's TensorFlow backend (and on tf_keras), "
        f"but Keras is running on its {backend!r} backend, which tfaccum does not support "
        f"yet. Received: keras.backend.backend()={backend!r} "
        f"(KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}). Set KERAS_BACKEND=tensorflow "
        "before Keras is first imported.")


def api_for_model_argument(value, argument):
    """`api_for(value)`, or a clear error naming `argument` if it is no model
    or runs on a Keras backend tfaccum does not serve."""
    if not is_model(value):
        raise TypeError(
            f"`{argument}` must be a compiled Keras model (keras.Model or "
            f"tf_keras.Model). Received: {argument}={value!r} (of type "
            f"{type(value).__name__})"
        )
    check_backend(value)
    return api_for(value)


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


def regularized_weights(model):
    """Names of `model`'s trainable weights that carry a weight regularizer.

    Keras 3 keeps it on the variable (`Variable.regularizer`, public, 3.7-3.15);
    tf_keras on the layer (`kernel_regularizer` and its kin, public).
    """
    names = [getattr(v, "path", v.name) for v in model.trainable_variables
             if getattr(v, "regularizer", None) is not None]
    if names or not is_tf_keras_model(model):
        return names
    attributes = ("kernel_regularizer", "bias_regularizer", "embeddings_regularizer",
                  "depthwise_regularizer", "pointwise_regularizer", "recurrent_regularizer",
                  "gamma_regularizer", "beta_regularizer")
    return [f"{layer.name}.{attribute}" for layer in flatten_layers(model)
            for attribute in attributes if getattr(layer, attribute, None) is not None]


def forget_traced_functions(model):
    """Makes Keras trace `model`'s train/test/predict functions again at their next use.

    Private: the `*_function` attributes `make_*_function` caches (Keras 3.5-3.15).
    """
    model.train_function = None
    model.test_function = None
    model.predict_function = None


def _compiled_with_optimizer(model, flag):
    return bool(getattr(model, flag, False)) and (
        getattr(model, "optimizer", None) is not None
    )


def api_for(model):
    """`Keras3` or `TfKeras`: what `model` was built with."""
    return TfKeras if is_tf_keras_model(model) else Keras3


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
