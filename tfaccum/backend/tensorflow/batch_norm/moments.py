"""Batch statistics pooled over an accumulation window.

`PooledMoments` adds each micro-batch's mean and variance into the window's
exactly; `WindowedMoments` is what a normalisation layer (Keras 3's
`AccumBatchNormalization` in `layers.py`, Keras 2's in `keras2.py`) shares to
stage its moments there; `BatchNormWindows` is the window observer that
commits, discards and applies them. Whoever builds an accumulation hook adds
`window_observers(model, strategy)` to its observers.
"""

import threading

import tensorflow as tf

from tfaccum import moment_pooling
from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.observing import WindowObserver


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
        pooled = moment_pooling.combine(
            tuple(v.read_value() for v in into), (count, mean, m2), tf.math)
        for variable, value in zip(into, pooled):
            variable.assign(value)

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
        self._combine(self._staged, *moment_pooling.summary(count, mean, variance))

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
            sums = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, list(moment_pooling.to_sums(count, mean, m2)))
            count, mean, m2 = moment_pooling.from_sums(*sums, tf.math)
        return (*moment_pooling.mean_and_variance(count, mean, m2, tf.math), count)

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
        self.pooled = [(layer, layer._new_pooled(strategy)) for layer in layers]

    def __repr__(self):
        return f"BatchNormWindows({[layer.name for layer, _ in self.pooled]})"

    # What it keeps are the layers' variables: its state is empty.

    def on_micro_step(self, state, step):
        for _, pooled in self.pooled:
            pooled.commit()
        return {}

    def on_leave_out(self, state, step):
        for _, pooled in self.pooled:
            pooled.discard()
        return {}

    def on_apply(self, state, update):
        for layer, _ in self.pooled:
            layer._apply_window_moments()
        return {}

    def on_reset(self, state):
        for _, pooled in self.pooled:
            pooled.reset()
        return {}

    def on_install(self, hook):
        super().on_install(hook)
        for layer, pooled in self.pooled:
            layer._set_pooled(pooled)

    def on_uninstall(self, hook):
        for layer, _ in self.pooled:
            layer._set_pooled(None)


def window_observers(model, strategy):
    """The observers `model`'s layers need: `[BatchNormWindows]` or `[]`."""
    layers = accumulating_layers(model)
    return [BatchNormWindows(layers, strategy)] if layers else []


class WindowedMoments:
    """What the hook calls on a normalisation layer that pools its window's moments.

    Shared by `AccumBatchNormalization` (Keras 3) and its Keras 2 twin
    (`batch_norm.keras2`). The layer stages each forward pass's moments in
    the window (`PooledMoments`) and leaves its moving statistics to the end
    of it.
    """

    _pooled = None  # a PooledMoments while an accumulation hook is installed

    def _new_pooled(self, strategy):
        if _keras_on_tf.batch_norm_renorm(self):
            raise ValueError(
                f"Layer {self.name!r}: AccumBatchNormalization with "
                "`renorm=True` is not supported under gradient accumulation. "
                "Received: renorm=True"
            )
        return PooledMoments(tuple(self.moving_mean.shape), strategy, name=self.name)

    def _set_pooled(self, pooled):
        object.__setattr__(self, "_pooled", pooled)  # untracked: not a weight

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
            count, mean, m2 = moment_pooling.from_sums(
                tf.maximum(count, 1.0), total, squares, tf.math)
            return (count, *moment_pooling.mean_and_variance(count, mean, m2, tf.math))

        return moments(*sums), moments(*reduced)

    def _window_variance(self, variance, count):
        """The variance the moving statistics move towards (the biased one)."""
        return variance

    def _apply_window_moments(self):
        """Moves the moving statistics once, towards the window's moments."""
        mean, variance, count = self._pooled.moments(across_replicas=self._synchronizes())
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


def accumulating_layers(model):
    """The `AccumBatchNormalization` layers of `model` (either Keras), nested ones included."""
    return [
        layer
        for layer in _keras_on_tf.flatten_layers(model)
        if isinstance(layer, WindowedMoments)
    ]
