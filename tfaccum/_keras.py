"""The one place that knows which Keras a model belongs to, and Keras' private parts.

tfaccum serves Keras 3 (`keras`, `tf.keras` in TensorFlow 2.16+) and Keras 2
(`tf_keras`, or `tf.keras` with `TF_USE_LEGACY_KERAS=1`) from one
implementation: `hook.py` and `callback.py` ask `api_for(model)` for the few
things the two do differently. `tf_keras` is never imported here; a model can
only be a `tf_keras` model once its user has imported it.

Every private Keras or TensorFlow attribute tfaccum uses is read or written
here, and nowhere else; each says which versions it was checked on. "Checked"
means read in the sources and exercised by the test suite, which CI runs on
the newest pair (TensorFlow 2.21, Keras 3.15.1, tf_keras 2.21) and, as a
smoke subset, on the oldest supported one (TensorFlow 2.16.2, Keras 3.7.0,
tf_keras 2.16.0).
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


def local_variable(initial_value, name):
    """A non-trainable variable of this machine only, even inside a strategy's scope.

    Observers keep what they see in such variables: with several replicas
    nothing of theirs is mirrored, broadcast or reduced, so a callback given
    to one worker only starts no collective. Private: a `ResourceVariable`
    built directly skips the strategy's variable creator (TensorFlow
    2.16-2.21; `tf.Variable` would make a mirrored one).
    """
    from tensorflow.python.ops import resource_variable_ops

    with tf.init_scope():
        return resource_variable_ops.ResourceVariable(initial_value, trainable=False, name=name)


def for_each_replica(strategy, fn, args=(), kwargs=None):
    """Runs `fn` on every replica, from the cross-replica context of a step.

    Private in TensorFlow 2: `StrategyExtendedV1.call_for_each_replica`,
    which `MirroredStrategy` and `MultiWorkerMirroredStrategy`'s extended
    objects keep (TensorFlow 2.16-2.21); `strategy.run` cannot be called
    inside a `merge_call`.
    """
    return strategy.extended.call_for_each_replica(fn, args=args, kwargs=kwargs)


def writes_summaries(strategy):
    """Whether this worker writes summaries: the chief, or the only one.

    Private in TensorFlow 2: `StrategyExtendedV1.should_save_summary`
    (TensorFlow 2.16-2.21), what Keras' own TensorBoard callback reads.
    """
    return getattr(strategy.extended, "should_save_summary", True)


def all_reduce_sum(grads):
    """`grads` summed over replicas (one batched all-reduce; `None` kept)."""
    present = [g for g in grads if g is not None]
    if not present:
        return list(grads)
    reduced = iter(
        tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, present)
    )
    return [None if g is None else next(reduced) for g in grads]


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


def batch_norm_moments(layer, inputs, mask):
    """Per-batch mean and variance, as `BatchNormalization` computes them.

    Private: `BatchNormalization._moments(inputs, mask)` (Keras 3.5-3.15).
    """
    return layer._moments(inputs, mask)


def tf_keras_training_value(layer, training):
    """What tf_keras' `BatchNormalization` takes `training` to be (False if frozen).

    Private: `BatchNormalizationBase._get_training_value` (tf_keras 2.16-2.21).
    """
    return layer._get_training_value(training)


def tf_keras_batch_norm_moments(layer, inputs, axes, mask):
    """tf_keras' `BatchNormalization` moments over `axes` (masked if `mask`).

    Private: `BatchNormalizationBase._moments` and `_param_dtype` (tf_keras 2.16-2.21).
    """
    return layer._moments(tf.cast(inputs, layer._param_dtype), axes, keep_dims=False, mask=mask)


def batch_norm_reduction_axes(layer):
    """The axes `BatchNormalization` reduces over (set when it is built).

    Private: `BatchNormalization._reduction_axes` (Keras 3.5-3.15).
    """
    return layer._reduction_axes


def batch_norm_renorm(layer):
    """Whether the layer uses batch renormalization.

    `renorm` exists on Keras 3.14+ (and on tf_keras); earlier Keras 3
    releases (3.5-3.13) have no renormalization: `False` there.
    """
    return bool(getattr(layer, "renorm", False))


# -- what a compiled loss averages over ---------------------------------------

# Reductions that divide by the number of (unmasked) elements; tf_keras'
# "auto" is "sum_over_batch_size" in `fit`.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "auto")


def compiled_loss_container(model):
    """The object holding a model's compiled losses, or `None`.

    Private: Keras 3's `Trainer._compile_loss` (a `CompileLoss`, Keras
    3.7-3.15) and tf_keras' `Model.compiled_loss` (a `LossesContainer`,
    2.16-2.21). Either is built (its losses resolved per output) before the
    first step under a distribution strategy, else while it traces (`build`).
    """
    container = getattr(model, "_compile_loss", None)
    if container is None and is_tf_keras_model(model):
        container = getattr(model, "compiled_loss", None)
    return container


def compiled_losses_of(container):
    """`[(output name, loss)]` of a built container, else `None`.

    Private: `CompileLoss._flat_losses`, namedtuples `(path, loss,
    loss_weights, name)` (Keras 3.7-3.15); `LossesContainer._losses` and
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


def may_hold_several_losses(model):
    """Whether `model`'s compiled loss may hold two or more per-output losses.

    Read from the built container where it is built, else from what
    `compile` received: several losses, or one loss (which tf_keras, and
    Keras 3 for some structures, repeat per output) on a model whose outputs
    are several or not known yet. Private: `CompileLoss._user_loss` (Keras
    3.7-3.15), `LossesContainer._user_losses` (tf_keras 2.16-2.21).
    """
    container = compiled_loss_container(model)
    if container is None:
        return False
    built = compiled_losses_of(container)
    if built is not None:
        return len(built) >= 2
    user = getattr(container, "_user_loss", getattr(container, "_user_losses", None))
    losses = [loss for loss in tf.nest.flatten(user) if loss is not None]
    if len(losses) >= 2:
        return True
    if not losses or tf.nest.is_nested(user):
        return False
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        outputs = None
    return outputs is None or len(tf.nest.flatten(outputs)) >= 2


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


def replica_loss_share(model):
    """What Keras multiplies each replica's loss by under the model's strategy.

    1 / replicas: the replicas' gradients are then summed. Keras 3 releases
    without `scale_loss_for_distribution` (3.7 among those tested) do not
    divide: each replica's mean loss counts whole, and plain training under
    a strategy takes replicas times the one-device gradient. Private:
    `keras.src.losses.loss.scale_loss_for_distribution` (Keras 3.8-3.15).
    """
    replicas = model.distribute_strategy.num_replicas_in_sync
    if not is_tf_keras_model(model):
        from keras.src.losses import loss as keras_loss

        if not hasattr(keras_loss, "scale_loss_for_distribution"):
            return 1.0
    return 1.0 / replicas


def as_in_total_loss(loss, value):
    """`value`, what compiled `loss` returned, as the loss container adds it up.

    Under a strategy a loss averaged per batch is divided by the number of
    replicas: Keras 3 does it inside the loss's call, tf_keras' container
    after it.
    """
    tf_keras = sys.modules.get("tf_keras")
    if (
        tf_keras is not None
        and isinstance(loss, tf_keras.losses.Loss)
        and loss.reduction in ("auto", "sum_over_batch_size")
    ):
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:
            return value * (1.0 / replicas)
    return value


def keras_mask(x):
    """The Keras mask a tensor carries (`_keras_mask`), or `None`."""
    return getattr(x, "_keras_mask", None)


def loss_divisor(loss, values, mask, sample_weight):
    """What Keras divides `loss` by, whether that is a fixed multiple of the samples, and
    whether it is above 0 in every micro-batch with a sample.

    `values` are the per-element losses `loss.call` returned (they may carry
    a mask of their own, as `ignore_class` does) and `mask` the one `y_pred`
    carried. Under `"sum_over_batch_size"` (and `"mean"`) Keras divides by
    the number of unmasked elements (`keras.losses.Loss.__call__`, 3.7-3.15).
    Returns `(None, False, False)` where it does not divide by a count
    (`"sum"`, `"mean_with_sample_weight"`, no reduction) or `values` is unknown.
    """
    reduction = getattr(loss, "reduction", None)
    if values is None or reduction not in _MEAN_REDUCTIONS:
        return None, False, False
    own = keras_mask(values)
    if own is not None:
        mask = own if mask is None else tf.logical_and(tf.cast(mask, tf.bool), tf.cast(own, tf.bool))
    if mask is not None:
        return tf.cast(tf.reduce_sum(tf.cast(mask, tf.int64)), tf.int64), False, False
    values = tf.convert_to_tensor(values)  # a loss may return a Python number
    shape = values.shape
    size = tf.size(values, out_type=tf.int64)
    if sample_weight is not None:
        # As `reduce_weighted_values` lines the weights up with the losses.
        # Private: `keras.src.losses.loss.squeeze_or_expand_to_same_rank`
        # (Keras 3.7-3.15).
        from keras.src.losses.loss import squeeze_or_expand_to_same_rank

        values, weights = squeeze_or_expand_to_same_rank(
            values, tf.cast(sample_weight, values.dtype)
        )
        if values.shape.rank != weights.shape.rank or values.shape != weights.shape:
            shape = tf.broadcast_static_shape(values.shape, weights.shape)
            size = tf.reduce_prod(
                tf.broadcast_dynamic_shape(
                    tf.shape(values, out_type=tf.int64), tf.shape(weights, out_type=tf.int64)
                )
            )
    proportional = shape.rank is not None and (
        shape.rank == 0 or shape[1:].is_fully_defined()
    )
    # A scalar counts 1; otherwise a fixed number of elements per sample.
    positive = proportional and (shape.rank == 0 or shape[1:].num_elements() > 0)
    return size, proportional, positive


def keep_as_function_call(cond_output):
    """Asks TensorFlow not to inline the update branch into the step's graph.

    Inlined (TensorFlow's default), every op of the optimizer update is
    visited on every micro-step, as a dead branch, though it runs once per
    window; kept as a function call, a micro-step skips it in one op. XLA
    compiles `If` itself and needs nothing.

    Private: the op attribute `_lower_using_switch_merge`, set through
    `Operation._set_attr` (TensorFlow 2.16-2.21; `tf.cond` sets the same
    attribute for its own lowering choice). If TensorFlow changes it, the
    default (correct, slightly slower) is kept.
    """
    if tf.executing_eagerly():
        return
    try:
        from tensorflow.core.framework import attr_value_pb2

        op = cond_output.op
        while op.type not in ("If", "StatelessIf"):
            op = op.inputs[0].op
        op._set_attr("_lower_using_switch_merge", attr_value_pb2.AttrValue(b=False))
    except Exception:  # noqa: BLE001 - a missed speed-up, nothing worse
        pass


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


class _Keras3MultiWorkerPatch:
    """Replaces two functions of Keras 3's TensorFlow trainer across workers.

    See `tfaccum.multi_worker`. Private: `keras.src.backend.tensorflow.trainer`'s
    `reduce_per_replica`, `_collective_all_reduce_multi_worker` and
    `TensorFlowTrainer._maybe_symbolic_build`, `Model._distribute_strategy`
    and `Model._symbolic_build` (Keras 3.7-3.15), replaced process-wide while
    installed (only where several workers are involved do they act).
    """

    def __init__(self):
        self._originals = {}

    @staticmethod
    def _module():
        from keras.src.backend.tensorflow import trainer

        return trainer

    def missing(self):
        """The private names this Keras lacks (empty when the patch fits)."""
        module = self._module()
        return [
            name
            for name, owner in (
                ("reduce_per_replica", module),
                ("_collective_all_reduce_multi_worker", module),
                ("_maybe_symbolic_build", getattr(module, "TensorFlowTrainer", None)),
            )
            if not hasattr(owner, name)
        ]

    def install(self):
        if self._originals:
            return
        module = self._module()
        trainer = module.TensorFlowTrainer
        reduce_per_replica = module.reduce_per_replica
        maybe_symbolic_build = trainer._maybe_symbolic_build

        def across_workers(strategy):
            return module._collective_all_reduce_multi_worker(strategy)

        def reduce_logs(values, strategy, reduction):
            if reduction in ("auto", "mean") and across_workers(strategy):
                return tf.nest.map_structure(
                    lambda v: (
                        strategy.reduce("MEAN", v, axis=None)
                        if isinstance(v, tf.distribute.DistributedValues)
                        else v
                    ),
                    values,
                )
            return reduce_per_replica(values, strategy, reduction)

        def symbolic_build(model, iterator=None, data_batch=None):
            strategy = model._distribute_strategy
            if iterator is None or strategy is None or not across_workers(strategy):
                return maybe_symbolic_build(model, iterator=iterator, data_batch=data_batch)
            for step in iterator:  # (step, iterator), or (begin, end, iterator) from 3.10
                data_batch = tf.nest.map_structure(
                    lambda v: (
                        strategy.experimental_local_results(v)[0]
                        if isinstance(v, tf.distribute.DistributedValues)
                        else v
                    ),
                    next(step[-1]),
                )
                break
            with strategy.scope():
                model._symbolic_build(data_batch=data_batch)

        self._originals.update(reduce=reduce_per_replica, build=maybe_symbolic_build)
        module.reduce_per_replica = reduce_logs
        trainer._maybe_symbolic_build = symbolic_build

    def remove(self):
        if not self._originals:
            return
        module = self._module()
        module.reduce_per_replica = self._originals["reduce"]
        module.TensorFlowTrainer._maybe_symbolic_build = self._originals["build"]
        self._originals.clear()


keras3_multi_worker_patch = _Keras3MultiWorkerPatch()


# -- window-wide losses (gradient caching) -----------------------------------------


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


# -- what a model's training changes --------------------------------------------------


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
