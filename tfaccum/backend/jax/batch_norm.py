"""Accumulation-aware batch normalization on JAX, a part the hook composes.

`AccumBatchNormalization` is Keras' `BatchNormalization` whose moving
statistics move once per window, towards the moments of every sample of the
window pooled exactly (`tfaccum.moment_pooling`), as TensorFlow's twin
(`tfaccum.backend.tensorflow.batch_norm`). On JAX the forward pass runs
inside the compiled step's gradient: while the step traces, each such layer
normalises its micro-batch with its own moments, as Keras does, and hands
them out of the gradient as its auxiliary output (`staging`); the
`BatchNormWindows` observer pools them in its device state, micro-batch by
micro-batch, and when the window is applied the hook moves the layers'
moving statistics, in the trainer's state, once (`move`).
"""

import contextlib
import threading

import jax
import jax.numpy as jnp
import keras
from keras import ops

from tfaccum import moment_pooling
from tfaccum.batch_norm_conversion import saved_as
from tfaccum._keras.models import (
    batch_norm_moments, batch_norm_reduction_axes, flatten_layers)
from tfaccum.observing import WindowObserver

_staged = threading.local()  # the list the step being traced collects moments in


@contextlib.contextmanager
def staging():
    """While the step traces: `[(layer, count, mean, variance)]` of every call of an
    `AccumBatchNormalization` in training."""
    outer = getattr(_staged, "moments", None)
    _staged.moments = []
    try:
        yield _staged.moments
    finally:
        _staged.moments = outer


@keras.saving.register_keras_serializable(package="tfaccum")
class AccumBatchNormalization(keras.layers.BatchNormalization):
    """`BatchNormalization` whose moving statistics see the whole accumulation window.

    The same layer as on TensorFlow (see `tfaccum.AccumBatchNormalization`
    there): the same arguments, defaults, weights and `get_config`; without
    gradient accumulation exactly `BatchNormalization`. Under the callback on
    Keras' JAX backend each micro-batch is normalised with its own
    statistics, and `moving_mean` and `moving_variance` move once per
    optimizer update, with `momentum` applied once, towards the mean and
    variance of every sample of the window. A dropped window leaves them
    as they were.

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
        staged = getattr(_staged, "moments", None)
        if (staged is None or not (training and self.trainable)
                or (mask is not None and len(mask.shape) != len(inputs.shape) - 1)):
            return super().call(inputs, training=training, mask=mask)
        # BatchNormalization's training branch, the moving statistics left to
        # the window's end.
        inputs = ops.cast(inputs, keras.backend.result_type(inputs.dtype, "float32"))
        mean, variance = batch_norm_moments(self, inputs, mask)
        if mask is None:
            count = 1.0
            for axis in batch_norm_reduction_axes(self):
                count *= inputs.shape[axis]
        else:
            count = ops.sum(ops.cast(mask, "float32"))
        staged.append((self, ops.cast(count, "float32"), mean, variance))
        gamma = ops.cast(self.gamma, inputs.dtype) if self.scale else None
        beta = ops.cast(self.beta, inputs.dtype) if self.center else None
        outputs = ops.batch_normalization(x=inputs, mean=mean, variance=variance,
                                          axis=self.axis, offset=beta, scale=gamma,
                                          epsilon=self.epsilon)
        return ops.cast(outputs, self.compute_dtype)


class ConvertedBatchNormalization(AccumBatchNormalization):
    """What `convert_batch_norm` makes of a `BatchNormalization` on JAX: saved as one
    (`tfaccum.batch_norm_conversion.saved_as`)."""


saved_as(ConvertedBatchNormalization, keras.layers.BatchNormalization)


def accumulating_layers(model):
    """`model`'s `AccumBatchNormalization` layers, nested ones included."""
    return [layer for layer in flatten_layers(model)
            if isinstance(layer, AccumBatchNormalization)]


class BatchNormWindows(WindowObserver):
    """Pools the moments of a model's `AccumBatchNormalization` layers per window.

    Its state, per layer `i`: the open window's pooled `(count, mean, m2)`
    (`count_i`, `mean_i`, `m2_i`) and the last applied window's mean and
    variance (`moved_mean_i`, `moved_variance_i`, `moved_count_i`), which
    `move` writes into the moving statistics once (`pending`).

    Args:
        layers: The model's `AccumBatchNormalization` layers.
    """

    def __init__(self, layers):
        self.layers = list(layers)

    def __repr__(self):
        return f"BatchNormWindows({[layer.name for layer in self.layers]})"

    def initial(self):
        state = {"pending": jnp.zeros((), jnp.int32)}
        for i, layer in enumerate(self.layers):
            shape = tuple(layer.moving_mean.shape)
            for name in ("count", "moved_count"):
                state[f"{name}_{i}"] = jnp.zeros((), jnp.float32)
            for name in ("mean", "m2", "moved_mean", "moved_variance"):
                state[f"{name}_{i}"] = jnp.zeros(shape, jnp.float32)
        return state

    def on_micro_step(self, state, step):
        changed = {}
        for i, layer in enumerate(self.layers):
            calls = step.moments.get(layer, [])
            if len(calls) > 1:
                raise ValueError(
                    f"AccumBatchNormalization layer {layer.name!r} is called {len(calls)} "
                    "times in one train step (shared between inputs, or inside a shared "
                    "sub-model). BatchNormalization moves its statistics once per call; "
                    "a window pools them once per layer: a shared layer cannot be the "
                    "large batch's. Give each call a layer of its own, or keep this one a "
                    "plain keras.layers.BatchNormalization.")
            pooled = (state[f"count_{i}"], state[f"mean_{i}"], state[f"m2_{i}"])
            for count, mean, variance in calls:
                pooled = moment_pooling.combine(
                    pooled, moment_pooling.summary(count, mean.astype(jnp.float32),
                                                   variance.astype(jnp.float32)), jnp)
            changed.update({f"count_{i}": pooled[0], f"mean_{i}": pooled[1],
                            f"m2_{i}": pooled[2]})
        return changed

    def on_apply(self, state, update):
        changed = {"pending": jnp.ones((), jnp.int32)}
        for i in range(len(self.layers)):
            count = state[f"count_{i}"]
            mean, variance = moment_pooling.mean_and_variance(
                count, state[f"mean_{i}"], state[f"m2_{i}"], jnp)
            changed.update({f"moved_count_{i}": count, f"moved_mean_{i}": mean,
                            f"moved_variance_{i}": variance})
        return changed

    def on_reset(self, state):
        if state is None:  # told on the host before any micro-batch: nothing pooled
            return {}
        changed = {}
        for i in range(len(self.layers)):
            changed[f"count_{i}"] = jnp.zeros_like(state[f"count_{i}"])
            changed[f"mean_{i}"] = jnp.zeros_like(state[f"mean_{i}"])
            changed[f"m2_{i}"] = jnp.zeros_like(state[f"m2_{i}"])
        return changed

    def on_install(self, hook):
        super().on_install(hook)
        for layer in self.layers:
            if getattr(layer, "renorm", False):
                raise ValueError(
                    f"Layer {layer.name!r}: AccumBatchNormalization with `renorm=True` is "
                    "not supported under gradient accumulation. Received: renorm=True")
        variables = [id(v) for v in hook.model.non_trainable_variables]
        self._positions = [(variables.index(id(layer.moving_mean)),
                            variables.index(id(layer.moving_variance)))
                           for layer in self.layers]
        self._move = jax.jit(self._moved)

    def _moved(self, moving, state):
        new = []
        for i, layer in enumerate(self.layers):
            mean, variance = moving[2 * i], moving[2 * i + 1]
            moves = (state["pending"] > 0) & (state[f"moved_count_{i}"] > 0)
            momentum = layer.momentum
            for value, towards in ((mean, state[f"moved_mean_{i}"]),
                                   (variance, state[f"moved_variance_{i}"])):
                new.append(jnp.where(moves, value * momentum + towards.astype(value.dtype)
                                     * (1.0 - momentum), value))
        return new

    def move(self, non_trainable):
        """`non_trainable` (the trainer's) with the moving statistics moved towards the
        window just applied, once (none where no window was applied since)."""
        state = self.state()
        if state is None:
            return non_trainable
        non_trainable = list(non_trainable)
        moving = [non_trainable[p] for pair in self._positions for p in pair]
        for (mean, variance), (new_mean, new_variance) in zip(
                self._positions, _pairs(self._move(moving, state))):
            non_trainable[mean], non_trainable[variance] = new_mean, new_variance
        self.hook.set_observer_state(self, {"pending": jnp.zeros((), jnp.int32)})
        return non_trainable


def staging_for(observers):
    """`staging`, where a `BatchNormWindows` is among `observers`; else `None`."""
    return staging if any(isinstance(o, BatchNormWindows) for o in observers) else None


def moved(observers, non_trainable):
    """The trainer's non-trainable state after a window's end: the moving
    statistics of every `BatchNormWindows`' layers moved once."""
    for observer in observers:
        if isinstance(observer, BatchNormWindows):
            non_trainable = observer.move(non_trainable)
    return non_trainable


def _pairs(values):
    return list(zip(values[::2], values[1::2]))
