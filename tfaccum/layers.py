"""`AccumBatchNormalization`: batch statistics that see the whole window."""

import collections
import os
import tempfile
import threading
import warnings

import keras
import tensorflow as tf
from keras import ops

from tfaccum import _keras
from tfaccum.observers import WindowObserver


class PooledMoments:
    """Mean and variance of every sample of a window, added micro-batch by micro-batch.

    Combines counts, means and sums of squared deviations exactly (Chan et al.'s
    parallel algorithm), so the result is the mean and (biased) variance of
    all samples together: the variance within micro-batches plus the variance
    between them. A micro-batch's statistics are first staged (`stage()`, in
    the forward pass) and join the window only when its gradient does
    (`commit()`); a micro-batch left out of the window is `discard()`ed. Its
    variables live outside the layer, so the layer's weights and saved files
    stay those of `BatchNormalization`.
    """

    def __init__(self, shape, strategy, name="batch_normalization"):
        self.name = name
        self._traced = threading.local()  # forward passes staged per graph, per thread
        with tf.init_scope(), strategy.scope():

            def variable(name, value):
                return tf.Variable(
                    value,
                    trainable=False,
                    name=name,
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                )

            def moments(prefix):
                return (
                    variable(prefix + "_count", tf.zeros((), tf.float32)),
                    variable(prefix + "_mean", tf.zeros(shape, tf.float32)),
                    variable(prefix + "_m2", tf.zeros(shape, tf.float32)),
                )

            self.count, self.mean, self.m2 = moments("window")
            self._staged = moments("micro_batch")

    @staticmethod
    def _combine(into, count, mean, m2):
        into_count, into_mean, into_m2 = into
        total = into_count + count
        safe_total = tf.maximum(total, 1.0)
        delta = mean - into_mean
        into_m2.assign(into_m2 + m2 + tf.square(delta) * into_count * count / safe_total)
        into_mean.assign(into_mean + delta * count / safe_total)
        into_count.assign(total)

    def stage(self, count, mean, variance):
        """Adds a forward pass's statistics to the micro-batch being trained.

        Raises if the layer is called twice in one step (a shared layer):
        `BatchNormalization` moves its statistics once per call, a window
        pools them once per layer, so neither would be the large batch's.
        """
        calls = self._calls()
        graph = tf.compat.v1.get_default_graph() if not tf.executing_eagerly() else None
        calls[graph] = calls.get(graph, 0) + 1
        if calls[graph] > 1:
            raise ValueError(
                f"AccumBatchNormalization layer {self.name!r} is called {calls[graph]} "
                "times in one train step (shared between inputs, or inside a shared "
                "sub-model). BatchNormalization moves its statistics once per call; "
                "a window pools them once per layer: a shared layer cannot be the "
                "large batch's. Give each call a layer of its own, or keep this one a "
                "plain keras.layers.BatchNormalization."
            )
        self._combine(self._staged, count, mean, variance * count)

    def _calls(self):
        if not hasattr(self._traced, "calls"):
            self._traced.calls = {}
        return self._traced.calls

    def commit(self):
        """Moves the staged micro-batch into the window."""
        count, mean, m2 = self._staged
        self._combine(
            (self.count, self.mean, self.m2),
            count.read_value(),
            mean.read_value(),
            m2.read_value(),
        )
        self.discard()

    def discard(self):
        """Forgets the staged micro-batch (its gradient was left out)."""
        self._calls().clear()  # the step's forward passes are done
        _zero(self._staged)

    def moments(self, across_replicas=False):
        """The window's mean, (biased) variance and count.

        `across_replicas`: pool every replica's window (one all-reduce, in a
        replica context).
        """
        count, mean, m2 = self.count.read_value(), self.mean.read_value(), self.m2.read_value()
        if across_replicas:
            count, weighted, squares = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, [count, count * mean, m2 + count * tf.square(mean)]
            )
            mean = weighted / tf.maximum(count, 1.0)
            m2 = tf.maximum(squares - count * tf.square(mean), 0.0)
        return mean, m2 / tf.maximum(count, 1.0), count

    def reset(self):
        _zero((self.count, self.mean, self.m2))
        self.discard()


def _zero(variables):
    for variable in variables:
        variable.assign(tf.zeros_like(variable))


class BatchNormWindows(WindowObserver):
    """Pools the statistics of a model's `AccumBatchNormalization` layers per window."""

    per_replica = True  # each replica pools what its layers saw

    def __init__(self, layers, strategy):
        self.windows = [(layer, layer._new_window(strategy)) for layer in layers]

    def __repr__(self):
        return f"BatchNormWindows({[layer.name for layer, _ in self.windows]})"

    def on_micro_step(self, step):
        for _, pooled in self.windows:
            pooled.commit()

    def on_leave_out(self, step):
        for _, pooled in self.windows:
            pooled.discard()

    def on_apply(self, update):
        for layer, _ in self.windows:
            layer._apply_window_moments()

    def on_reset(self):
        for _, pooled in self.windows:
            pooled.reset()

    def on_install(self, hook):
        for layer, pooled in self.windows:
            layer._set_window(pooled)

    def on_uninstall(self, hook):
        for layer, _ in self.windows:
            layer._set_window(None)


def window_observers(model, strategy):
    """The observers `model`'s layers need: `[BatchNormWindows]` or `[]`."""
    layers = accumulating_layers(model)
    return [BatchNormWindows(layers, strategy)] if layers else []


class WindowedMoments:
    """What the hook calls on a normalisation layer that pools its window's moments.

    Shared by `AccumBatchNormalization` (Keras 3) and its Keras 2 twin
    (`tfaccum.keras2`). The layer stages each forward pass's moments in the
    window (`PooledMoments`) and leaves its moving statistics to the end of it.
    """

    _window = None  # a PooledMoments while an accumulation hook is installed

    def _new_window(self, strategy):
        if _keras.batch_norm_renorm(self):
            raise ValueError(
                f"Layer {self.name!r}: AccumBatchNormalization with "
                "`renorm=True` is not supported under gradient accumulation. "
                "Received: renorm=True"
            )
        return PooledMoments(tuple(self.moving_mean.shape), strategy, name=self.name)

    def _set_window(self, window):
        object.__setattr__(self, "_window", window)  # untracked: not a weight

    @staticmethod
    def _sample_count(inputs, mask, axes):
        """How many values each statistic was computed from (over `axes`, or the mask)."""
        if mask is not None:
            return tf.reduce_sum(tf.cast(mask, tf.float32))
        return tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), tf.float32)

    def _synchronizes(self, mask=None):
        """Whether statistics are taken over every replica.

        As `BatchNormalization(synchronized=True)` does (not with a mask).
        """
        context = tf.distribute.get_replica_context()
        return (
            getattr(self, "synchronized", False)
            and mask is None
            and context is not None
            and context.num_replicas_in_sync > 1
        )

    @classmethod
    def _synchronized_moments(cls, inputs, axes):
        """This replica's count, mean and variance, and those over every replica.

        One all-reduce of sums and sums of squares, as Keras' synchronized
        layer computes them: the batch is normalised with every replica's
        statistics, and the window stages this replica's share (so that a
        share left out for a non-finite gradient is left out of them too;
        the windows are pooled across replicas when applied).
        """
        inputs = tf.cast(inputs, tf.float32)
        sums = [cls._sample_count(inputs, None, axes), tf.reduce_sum(inputs, axes), tf.reduce_sum(tf.square(inputs), axes)]
        reduced = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, sums)

        def moments(count, total, squares):
            count = tf.maximum(count, 1.0)
            mean = total / count
            return count, mean, tf.maximum(squares / count - tf.square(mean), 0.0)

        return moments(*sums), moments(*reduced)

    def _window_variance(self, variance, count):
        """The variance the moving statistics move towards (the biased one)."""
        return variance

    def _apply_window_moments(self):
        """Moves the moving statistics once, towards the window's moments."""
        mean, variance, count = self._window.moments(across_replicas=self._synchronizes())
        variance = self._window_variance(variance, count)
        momentum = self.momentum
        self.moving_mean.assign(
            self.moving_mean * momentum
            + tf.cast(mean, self.moving_mean.dtype) * (1.0 - momentum)
        )
        self.moving_variance.assign(
            self.moving_variance * momentum
            + tf.cast(variance, self.moving_variance.dtype) * (1.0 - momentum)
        )


@keras.saving.register_keras_serializable(package="tfaccum")
class AccumBatchNormalization(WindowedMoments, keras.layers.BatchNormalization):
    """`BatchNormalization` whose moving statistics see the whole accumulation window.

    A drop-in for `keras.layers.BatchNormalization`: the same arguments,
    defaults, weights and `get_config`. Without gradient accumulation it is
    exactly `BatchNormalization`. While `GradientAccumulationCallback` (or an
    `AccumulationHook`) trains the model, each micro-batch is still normalised
    with its own statistics, but `moving_mean` and `moving_variance` are
    updated once per optimizer update, with `momentum` applied once, from the
    mean and variance of all samples of the window pooled exactly (within-
    plus between-micro-batch variance). So after accumulated training the
    moving statistics are those `BatchNormalization` would have at the large
    batch. A dropped window (`leftover="drop"`) leaves them untouched.

    Plain `BatchNormalization` under accumulation updates its statistics from
    each small micro-batch (keras-team/keras#16633).

    With several replicas and `synchronized=True`, each forward pass's
    statistics are taken over every replica (one all-reduce, as the Keras
    layer does) and the moving statistics equal single-device
    `BatchNormalization` at the global large batch. With
    `synchronized=False` each replica pools its own share of the window, as
    `BatchNormalization` keeps each replica's share of a batch. `renorm=True`
    is not supported under accumulation (a clear error says so).

    Example:

    ```python
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(16, 3),
        tfaccum.AccumBatchNormalization(),
        keras.layers.ReLU(),
    ])
    ```
    """

    def call(self, inputs, training=None, mask=None):
        window = self._window
        if window is None or not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            return super().call(inputs, training=training, mask=mask)  # its error
        # BatchNormalization's training branch, with the moving statistics
        # left to the end of the window.
        inputs = ops.cast(inputs, keras.backend.result_type(inputs.dtype, "float32"))
        axes = _keras.batch_norm_reduction_axes(self)
        if self._synchronizes(mask):
            share, (_, mean, variance) = self._synchronized_moments(inputs, axes)
        else:
            mean, variance = _keras.batch_norm_moments(self, inputs, mask)
            share = (self._sample_count(inputs, mask, axes), mean, variance)
        window.stage(*share)
        gamma = ops.cast(self.gamma, inputs.dtype) if self.scale else None
        beta = ops.cast(self.beta, inputs.dtype) if self.center else None
        outputs = ops.batch_normalization(
            x=inputs,
            mean=mean,
            variance=variance,
            axis=self.axis,
            offset=beta,
            scale=gamma,
            epsilon=self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)


def accumulating_layers(model):
    """The `AccumBatchNormalization` layers of `model` (either Keras), nested ones included."""
    return [
        layer
        for layer in _keras.flatten_layers(model)
        if isinstance(layer, WindowedMoments)
    ]


def convert_batch_norm(model, in_place=False, verbose=1):
    """Makes every `BatchNormalization` of `model` accumulation-aware.

    Each `keras.layers.BatchNormalization`, at any depth (a backbone nested in
    a functional model, Sequential inside functional, a keras_hub backbone
    inside its task), becomes an `AccumBatchNormalization`: the same layer,
    configuration and weights (moving statistics included), only its class
    changes. The model keeps its kind: a keras_hub task stays that task, with
    its preprocessor.

    Args:
        model: A Keras 3 or tf_keras (Keras 2) model of any kind.
        in_place: `False` (default): convert a copy (made by saving and
            loading the model in memory, so it must be serializable) and
            leave `model` as it was. `True`: convert `model` itself, which
            works for any model, subclassed ones included; a model already
            trained must be compiled again afterwards.
        verbose: `1` prints how many layers were converted; `0` is silent.

    Returns:
        The converted model (`model` itself if `in_place`).

    Raises:
        ValueError: for a subclass of `BatchNormalization` (its own code
            would be lost: make it subclass `AccumBatchNormalization`
            instead); for a model that cannot be copied (pass `in_place=True`).

    Example:

    ```python
    backbone = keras.applications.MobileNetV2(include_top=False, weights=None)
    inputs = keras.Input((96, 96, 3))
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(backbone(inputs)))
    model = tfaccum.convert_batch_norm(keras.Model(inputs, outputs))
    # Converted 52 BatchNormalization layers to AccumBatchNormalization.
    ```
    """
    kind = _kind_of(model)
    if not isinstance(in_place, bool):
        raise ValueError(f"`in_place` must be True or False. Received: in_place={in_place!r}")
    if type(verbose) is not int or verbose not in (0, 1):
        raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
    _refuse_batch_norm_subclasses(model, kind.batch_norm)
    target = model if in_place else _copy(model, kind.load_model)
    converted = 0
    for layer in _keras.flatten_layers(target):
        if type(layer) is kind.batch_norm:
            layer.__class__ = kind.converted
            converted += 1
    if in_place and converted:
        _keras.forget_traced_functions(target)
    if verbose:
        _keras.print_msg(f"Converted {converted} BatchNormalization layer"
                         f"{'' if converted == 1 else 's'} to AccumBatchNormalization.")
    if not converted and not accumulating_layers(target):
        warnings.warn(
            f"`convert_batch_norm` found no BatchNormalization layer in model "
            f"{model.name!r}: nothing was converted.",
            stacklevel=2,
        )
    return target


_Kind = collections.namedtuple("_Kind", "batch_norm converted load_model")


def _kind_of(model):
    """The classes a Keras 3 or a tf_keras (Keras 2) model converts with."""
    if isinstance(model, keras.Model):
        return _Kind(keras.layers.BatchNormalization, ConvertedBatchNormalization,
                     keras.models.load_model)
    if _keras.is_tf_keras_model(model):
        import tf_keras

        from tfaccum import keras2

        return _Kind(tf_keras.layers.BatchNormalization, keras2.ConvertedBatchNormalization,
                     tf_keras.models.load_model)
    raise ValueError(f"`model` must be a Keras model. Received: model={model!r}")


class ConvertedBatchNormalization(AccumBatchNormalization):
    """What `convert_batch_norm` makes of a `BatchNormalization`: saved as one.

    An `AccumBatchNormalization` that is saved exactly as the
    `keras.layers.BatchNormalization` it was (same class name in the config
    and the weights file), so a converted model saves and loads anywhere,
    without tfaccum, and so do models that rebuild their layers from their
    arguments when loaded (keras_hub backbones). A loaded model has plain
    `BatchNormalization` again: convert it again to keep accumulating.
    """


def saved_as(cls, original):
    """Makes Keras save `cls` as `original`: same name and module.

    Keras writes a layer's class name and module into the model's config and
    its class name into the weights file's paths.
    """
    cls.__name__ = original.__name__
    cls.__qualname__ = original.__qualname__
    cls.__module__ = original.__module__
    return cls


saved_as(ConvertedBatchNormalization, keras.layers.BatchNormalization)


def _refuse_batch_norm_subclasses(model, batch_norm):
    subclasses = [
        f"{layer.name!r} ({type(layer).__name__})"
        for layer in _keras.flatten_layers(model)
        if isinstance(layer, batch_norm)
        and not isinstance(layer, WindowedMoments)
        and type(layer) is not batch_norm
    ]
    if subclasses:
        raise ValueError(
            "`convert_batch_norm` converts `keras.layers.BatchNormalization` "
            "itself; these layers subclass it, and their own code would be "
            f"lost: {', '.join(subclasses)}. Make them subclass "
            "`tfaccum.AccumBatchNormalization` instead."
        )


def _copy(model, load_model):
    """A copy of `model`: saved and loaded (weights, assets and its class kept)."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.keras")
        try:
            model.save(path)
            return load_model(path, compile=False, safe_mode=False)
        except Exception as error:  # noqa: BLE001 - any reason it cannot be copied
            raise ValueError(
                f"`convert_batch_norm` could not copy model {model.name!r} (a "
                f"{type(model).__name__}) by saving and loading it: "
                f"{type(error).__name__}: {error}. Pass `in_place=True` to convert "
                "the model itself, or use `tfaccum.AccumBatchNormalization` in "
                "its code."
            ) from error
