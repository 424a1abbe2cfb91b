"""`AccumBatchNormalization`: batch statistics that see the whole window."""

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

    def __init__(self, shape, strategy):
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
        """Adds a forward pass's statistics to the micro-batch being trained."""
        self._combine(self._staged, count, mean, variance * count)

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
        _zero(self._staged)

    def moments(self):
        return self.mean.read_value(), self.m2 / self.count

    def reset(self):
        _zero((self.count, self.mean, self.m2))
        self.discard()


def _zero(variables):
    for variable in variables:
        variable.assign(tf.zeros_like(variable))


class BatchNormWindows(WindowObserver):
    """Pools the statistics of a model's `AccumBatchNormalization` layers per window."""

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


@keras.saving.register_keras_serializable(package="tfaccum")
class AccumBatchNormalization(keras.layers.BatchNormalization):
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

    With several replicas each replica pools its own share of the window and
    updates the moving statistics as `BatchNormalization(synchronized=False)`
    does with its share of a batch (Keras keeps per-replica statistics there,
    not the single-device ones). `synchronized=True` with several replicas
    and `renorm=True` are not supported under accumulation (a clear error
    says so).

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

    _window = None  # a PooledMoments while an accumulation hook is installed

    def call(self, inputs, training=None, mask=None):
        window = self._window
        if window is None or not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            return super().call(inputs, training=training, mask=mask)  # its error
        # BatchNormalization's training branch, with the moving statistics
        # left to the end of the window.
        inputs = ops.cast(inputs, keras.backend.result_type(inputs.dtype, "float32"))
        mean, variance = _keras.batch_norm_moments(self, inputs, mask)
        window.stage(self._sample_count(inputs, mask), mean, variance)
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

    def _sample_count(self, inputs, mask):
        """How many values each statistic was computed from."""
        if mask is not None:
            count = tf.reduce_sum(tf.cast(mask, tf.float32))
        else:
            shape = tf.shape(inputs)
            count = tf.cast(
                tf.reduce_prod(tf.gather(shape, _keras.batch_norm_reduction_axes(self))), tf.float32
            )
        return count

    # -- called by AccumulationHook ------------------------------------------

    def _new_window(self, strategy):
        if _keras.batch_norm_renorm(self):
            raise ValueError(
                f"Layer {self.name!r}: AccumBatchNormalization with "
                "`renorm=True` is not supported under gradient accumulation. "
                "Received: renorm=True"
            )
        if self.synchronized and strategy.num_replicas_in_sync > 1:
            raise ValueError(
                f"Layer {self.name!r}: AccumBatchNormalization with "
                "`synchronized=True` with several replicas is not supported "
                "under gradient accumulation yet. Received: synchronized=True "
                f"under {type(strategy).__name__} with "
                f"{strategy.num_replicas_in_sync} replicas. Use "
                "synchronized=False: each replica then pools its own window."
            )
        return PooledMoments(tuple(self.moving_mean.shape), strategy)

    def _set_window(self, window):
        object.__setattr__(self, "_window", window)  # untracked: not a weight

    def _apply_window_moments(self):
        """Moves the moving statistics once, towards the window's moments."""
        mean, variance = self._window.moments()
        momentum = self.momentum
        self.moving_mean.assign(
            self.moving_mean * momentum
            + ops.cast(mean, self.moving_mean.dtype) * (1.0 - momentum)
        )
        self.moving_variance.assign(
            self.moving_variance * momentum
            + ops.cast(variance, self.moving_variance.dtype) * (1.0 - momentum)
        )


def accumulating_layers(model):
    """The `AccumBatchNormalization` layers of `model`, nested ones included."""
    return [
        layer
        for layer in _keras.flatten_layers(model)
        if isinstance(layer, AccumBatchNormalization)
    ]


def convert_batch_norm(model):
    """Returns a copy of `model` with every `BatchNormalization` made accumulation-aware.

    Each `keras.layers.BatchNormalization` becomes an `AccumBatchNormalization`
    with the same configuration; every weight (moving statistics included) is
    carried over. Works for Sequential and functional models.

    Args:
        model: A Sequential or functional Keras model.

    Example:

    ```python
    model = tfaccum.convert_batch_norm(keras.applications.ResNet50(weights=None))
    ```
    """

    def clone(layer):
        config = layer.get_config()
        if isinstance(layer, keras.layers.BatchNormalization) and not isinstance(
            layer, AccumBatchNormalization
        ):
            return AccumBatchNormalization.from_config(config)
        return layer.__class__.from_config(config)

    try:
        copy = keras.models.clone_model(model, clone_function=clone)
    except ValueError:
        raise ValueError(
            "`convert_batch_norm` copies Sequential and functional models. "
            f"Received: a {type(model).__name__}; for a subclassed model, "
            "use `tfaccum.AccumBatchNormalization` in its code instead."
        ) from None
    copy.set_weights(model.get_weights())
    return copy
