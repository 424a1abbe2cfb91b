"""Window-wide losses on JAX: gradient caching, a part the hook composes.

A model compiled with a `tfaccum.WindowLoss` trains as on TensorFlow
(`tfaccum.backend.tensorflow.window_loss.gradient_cache`; Gao et al. 2021):

1. each micro-step runs the forward pass only and keeps what the window
   needs of it: the inputs, targets, sample weights, the outputs and the
   non-trainable state the forward pass started from (the seed generators'
   states its dropout masks were drawn from);
2. when the window ends, the compiled loss is computed over the window's
   outputs, as the large batch's step computes it, with its gradient with
   respect to those outputs (`jax.value_and_grad`);
3. each micro-batch's forward pass runs again from its kept state (the same
   masks) and carries its slice of that gradient to the weights
   (`jax.vjp`), added into the window's sum; the optimizer applies it once.

Activations are held for one micro-batch at a time, with the window's inputs
and outputs. Under `keras.distribution.DataParallel` the micro-batches are
arrays split over the devices and the functions are compiled for the whole
arrays: the window's outputs are gathered across devices where the loss
needs them, as in the large batch.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np

from tfaccum._keras import counted_losses
from tfaccum._keras import models
from tfaccum import window_losses
from tfaccum._keras import Keras3
from tfaccum._keras.models import computes_loss_as_keras
from tfaccum._keras.models import scales_loss_dynamically
from tfaccum.backend.jax import _keras_on_jax
from tfaccum.counts import DEVICE_WINDOW_COUNTS
from tfaccum.counts import WINDOW_COUNTS
from tfaccum.counts import device_index
from tfaccum.observing import Update
from tfaccum.backend.jax.step import squared_norm


def check_served(model, loss, configuration):
    """Refuses, by name, what a window-wide loss cannot meet on JAX."""
    def refuse(what, why, fix):  # as the core's (`window_losses.check_meets`)
        raise ValueError(
            f"Model {model.name!r} is compiled with the window-wide loss {loss!r}, "
            f"which cannot meet {what}: {why}. {fix}")

    if scales_loss_dynamically(model.optimizer):
        refuse("mixed_float16's LossScaleOptimizer on Keras' JAX backend",
               "the window's loss would have to be scaled before its gradient to the "
               "outputs is taken, which is built on TensorFlow only",
               "Use mixed_bfloat16 (no loss scale) or float32, or KERAS_BACKEND=tensorflow.")
    if jax.process_count() > 1:
        refuse(f"several JAX processes ({jax.process_count()})",
               "the window's outputs are gathered over one process's devices only, so far",
               "Train it in one process (DataParallel over its devices).")
    window_losses.check_meets(
        model, loss, configuration, keras_step=_keras_on_jax.own_train_step(model) is None,
        keras_compute_loss=computes_loss_as_keras(model),
        compiled_metrics=Keras3.has_compiled_metrics(model),
        batch_norm=_keras_on_jax.batch_norm_layers(model))


class CachedWindow:
    """The micro-steps and window ends of a hook whose model has a window-wide loss.

    Args:
        hook: The JAX `AccumulationHook`; its counts, observers and the
            observers' states are the ones this part updates.
        jit: Whether to compile (as the hook's steps).
    """

    def __init__(self, hook, jit):
        self.hook = hook
        self.model = hook.model
        compile_ = (lambda f, donate=(): jax.jit(f, donate_argnums=donate)) if jit else (
            lambda f, donate=(): f)
        self._forward = compile_(self._forward_pass)
        self._window_gradient = compile_(self._gradient)
        self._replay = compile_(self._replay_one, (5,))
        self._update = compile_(self._apply, (0, 1, 3))
        # Keras' logs between window ends: what the metrics hold (not read here).
        self._logs = compile_(lambda metrics: _keras_on_jax.metrics_logs(self.model, metrics))
        self._kept = []  # one dict per micro-batch of the open window
        self._changed = None  # where the forward pass changes the non-trainable state
        self._replay_checked = False

    def __repr__(self):
        return f"CachedWindow(kept={len(self._kept)})"

    # -- compiled --------------------------------------------------------------------

    def _forward_pass(self, trainable, non_trainable, x):
        y_pred, new, losses = self.model.stateless_call(
            trainable, non_trainable, x, return_losses=True,
            **models.training_arguments(self.model))
        # Read while it traces: what only the trace shows.
        self._changed = [i for i, (a, b) in enumerate(zip(new, non_trainable)) if a is not b]
        self._losses = len(losses)
        self._masked = any(counted_losses.keras_mask(output) is not None
                           for output in keras.tree.flatten(y_pred))
        return y_pred, [new[i] for i in self._changed]

    def _gradient(self, trainable, non_trainable, metrics, ys, weights, outputs):
        """The window's loss over its outputs, its gradient with respect to them,
        Keras' logs and its metrics with the loss tracked (as the large batch's)."""
        model = self.model
        y, sample_weight, y_pred = (_joined(parts) for parts in (ys, weights, outputs))

        def loss_of(y_pred):
            loss, _ = model.stateless_compute_loss(
                trainable, non_trainable, metrics, x=None, y=y, y_pred=y_pred,
                sample_weight=sample_weight, training=True)
            return loss

        loss, output_grads = jax.value_and_grad(loss_of)(y_pred)
        # The tracker weighs the loss by the window's samples (read from `x`).
        logs, metrics = _keras_on_jax.update_metrics(model, metrics, loss,
                                                     (y_pred, y, sample_weight), y_pred)
        return loss, output_grads, logs, metrics

    def _replay_one(self, trainable, non_trainable, x, output_grads, start, accumulators):
        """One micro-batch's forward pass again, its rows of the window's output
        gradient carried to the weights and added; and its outputs."""
        model = self.model

        def outputs(trainable):
            y_pred, _ = model.stateless_call(trainable, non_trainable, x,
                                             **models.training_arguments(model))
            return y_pred

        y_pred, pullback = jax.vjp(outputs, trainable)
        rows = keras.tree.flatten(x)[0].shape[0]
        mine = jax.tree.map(
            lambda g, out: jax.lax.dynamic_slice_in_dim(g, start, rows).astype(out.dtype),
            output_grads, y_pred)
        (grads,) = pullback(mine)
        summed = [a + g.astype(jnp.float32) for a, g in zip(accumulators, grads)]
        return summed, y_pred

    def _apply(self, trainable, optimizer_variables, accumulators, observed, loss, window):
        """The window's gradient applied once; the observers see the update."""
        model = self.model
        grads = [a.astype(v.dtype) for a, v in zip(accumulators, trainable)]
        if observed:
            squares = [squared_norm([a]) for a in accumulators]
            counts = dict(zip(WINDOW_COUNTS, window))
            update = Update(squared_norm=sum(squares), mean_squared_norm=sum(squares),
                            variables=model.trainable_variables, variable_squares=squares,
                            gradient_scale=None, window=counts, counts=None, iterations=None,
                            loss=loss.astype(jnp.float32))
            observers = self.hook.observers
            observed = tuple(dict(s, **o.on_apply(s, update)) for o, s in zip(observers, observed))
            observed = tuple(dict(s, **o.on_reset(s)) for o, s in zip(observers, observed))
        trainable, optimizer_variables = model.optimizer.stateless_apply(
            optimizer_variables, grads, trainable)
        return trainable, optimizer_variables, observed

    # -- on the host -----------------------------------------------------------------

    def micro_step(self, state, data):
        """Runs the micro-batch's forward pass and keeps it; ends a full window."""
        hook, counts = self.hook, self.hook.counts
        trainable, non_trainable, optimizer_variables, metrics = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, changed = self._forward(trainable, non_trainable, x)
        self._check_forward()
        samples = _keras_on_jax.batch_size(data)
        self._kept.append(dict(x=x, y=y, sample_weight=sample_weight, y_pred=y_pred,
                               samples=samples,
                               started=[non_trainable[i] for i in self._changed]))
        non_trainable = list(non_trainable)
        for i, value in zip(self._changed, changed):
            non_trainable[i] = value
        state = (trainable, non_trainable, optimizer_variables, metrics)
        counts.add(micro_steps=1, samples=samples, window_micro_batches=1,
                   window_samples=samples)
        # Every sample is an item: the loss averages over the window's samples.
        index = (0,) * (counts.on_device.ndim - 1)
        for name in ("window_items", "items"):
            counts.on_device = counts.on_device.at[index + (device_index(name),)].add(samples)
        if counts.values["window_micro_batches"] >= hook.accumulation_steps:
            return self.end_window(state)
        return self._logs(metrics), state

    def end_window(self, state):
        """Applies the open window: its loss, the replays, one update."""
        hook, counts, kept = self.hook, self.hook.counts, self._kept
        trainable, non_trainable, optimizer_variables, metrics = state
        loss, output_grads, logs, metrics = self._window_gradient(
            trainable, non_trainable, metrics, *([part[name] for part in kept]
                                                 for name in ("y", "sample_weight", "y_pred")))
        accumulators = [jnp.zeros(v.shape, jnp.float32) for v in trainable]
        start = 0
        for part in kept:
            started = list(non_trainable)
            for i, value in zip(self._changed, part["started"]):
                started[i] = value
            accumulators, replayed = self._replay(
                trainable, started, part["x"], output_grads, jnp.asarray(start, jnp.int32),
                accumulators)
            if not self._replay_checked:
                self._check_replay(part["y_pred"], replayed)
            start += part["samples"]
        self._replay_checked = True
        window = counts.window_values()
        window[WINDOW_COUNTS.index("window_items")] = window[1]  # every sample an item
        trainable, optimizer_variables, hook._observed = self._update(
            trainable, optimizer_variables, accumulators, hook._observed, loss,
            jnp.asarray(window, jnp.int32))
        self._kept = []
        for name in DEVICE_WINDOW_COUNTS:
            counts.on_device = counts.on_device.at[..., device_index(name)].set(0)
        hook._ended(jnp.asarray(window + [0], jnp.int32), True, optimizer_variables)
        return logs, (trainable, non_trainable, optimizer_variables, metrics)

    def flush(self):
        """Applies a partial window from the model's variables, and writes them."""
        model = self.model
        _keras_on_jax.sync(model)
        state = [[v.value for v in variables]
                 for variables in _keras_on_jax.state_variables(model)]
        _, state = self.end_window(state)
        _keras_on_jax.restore(model, state)
        _keras_on_jax.republish(model)

    def reset(self):
        """Forgets the open window (dropped, or the hook removed)."""
        self._kept = []

    # -- checks --------------------------------------------------------------------

    def _check_forward(self):
        model = self.model
        if self._losses:
            raise ValueError(
                f"Model {model.name!r} adds losses of its own (`model.losses`: weight or "
                "activity regularizers, `add_loss`), which a window-wide loss does not take "
                "yet: the window's loss would miss them. Remove the regularizers, or "
                "compile with an ordinary loss.")
        if self._masked:
            raise ValueError(
                f"Model {model.name!r} has an output with a Keras mask, which a window-wide "
                "loss does not keep for the window's loss yet: the loss would be computed "
                "unmasked. Compile the masked output with an ordinary loss.")

    def _check_replay(self, first, replayed):
        """The first window's replays must draw what the first passes drew."""
        for a, b in zip(keras.tree.flatten(first), keras.tree.flatten(replayed)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            if not np.allclose(a, b, rtol=1e-3, atol=1e-5, equal_nan=True):
                raise ValueError(
                    f"Model {self.model.name!r} draws random numbers that the second forward "
                    "pass of its window-wide loss cannot draw again: the first window's "
                    f"replayed outputs differ from its first pass's by up to "
                    f"{float(np.nanmax(np.abs(a - b))):.3g}. The window's gradients would "
                    "flow through other draws than the ones its loss saw. Draw them from a "
                    "Keras seed generator, which tfaccum replays: a seeded layer "
                    "(`keras.layers.Dropout(rate, seed=...)`) or `keras.random.normal(shape, "
                    "seed=self.seed_generator)` with a `keras.random.SeedGenerator` made in "
                    "the layer's `__init__` (not NumPy's or Python's random numbers).")


def _joined(parts):
    """Micro-batches' structures joined along the batch axis (`None` stays `None`)."""
    if parts[0] is None:
        return None
    return jax.tree.map(lambda *leaves: jnp.concatenate(leaves, axis=0), *parts)
