"""Outputs whose losses average over counts of their own, accumulated apart (JAX).

A model whose outputs are masked differently (a per-token head and a
per-sequence head) divides each output's loss by its own count; the large
batch divides each by its window total. One weight per micro-batch cannot do
that: each such output's gradient (`_keras_on_jax.gradient_and_outputs`,
taken apart) is accumulated in a set of its own, times its count (its loss
as a sum), and divided by its window's total when the window ends
(`tfaccum.output_weighting`, as on TensorFlow); the step's main accumulators
keep the rest (outputs that count samples, regularization), weighted by
samples. Memory: one more accumulator per variable per such output.

The sets ride behind the main accumulators in the list the compiled steps
donate, followed by one float32 vector per device: each output's count and
loss sum over the window, then the rest's loss times samples (the window's
loss, for the dashboard).
"""

import jax
import jax.numpy as jnp
import keras

from tfaccum._keras import counted_losses
from tfaccum import items as said_items
from tfaccum import output_weighting
from tfaccum._keras import Keras3
from tfaccum._keras.models import compiled_losses_of
from tfaccum.backend.jax import _keras_on_jax


class OutputChannels:
    """The outputs a hook accumulates apart, found once.

    Args:
        names: The outputs' names, in the order their losses are computed.
        weights: Their `loss_weights` entries (`None` for 1).
    """

    def __init__(self, names, weights):
        self.names = list(names)
        self.weights = output_weighting.loss_weights(weights)

    def __repr__(self):
        return f"OutputChannels({self.names})"

    @classmethod
    def find(cls, model, state, data):
        """The outputs of `model`'s compiled losses that count differently, or
        `None`: two or more compiled losses, those with a count of their own (a
        mask or `ignore_class`), found by tracing the loss once without running
        it (`jax.eval_shape`), where no `count_items()` says the step's count."""
        built = compiled_losses_of(Keras3.loss_container(model))
        if built is not None and len(built) < 2:  # built before `fit`'s first step
            return None
        found = {}

        def trace(state, data):
            trainable, non_trainable, optimizer_variables, metrics = state
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            with counted_losses.loss_inputs(model) as seen, said_items.collected() as said:
                model.compute_loss_and_updates(
                    trainable, non_trainable, metrics, x, y, sample_weight, training=True,
                    optimizer_variables=optimizer_variables)
            outputs = seen["outputs"] if len(seen["outputs"]) >= 2 and not said else []
            found["outputs"] = [(o.name, o.weight) for o in outputs if o.count is not None]
            return jnp.zeros(())

        jax.eval_shape(trace, state, data)
        if not found["outputs"]:
            return None
        names, weights = zip(*found["outputs"])
        return cls(names, weights)

    def new(self, trainable, devices, dtype):
        """The sets (one per output, `dtype`) and the counts' vector (float32)."""
        arrays = [devices.zeros(v.shape, dtype) for _ in self.names for v in trainable]
        return arrays + [devices.zeros((2 * len(self.names) + 1,), jnp.float32)]

    def apart(self, seen, optimizer, optimizer_variables):
        """`gradient_and_outputs`' `apart`: each output's gradient times its loss
        weight and the loss scale (a `LossScaleOptimizer`'s, in its variables
        `optimizer_variables`), in the units of the step's."""
        positions = _keras_on_jax.loss_scale_positions(optimizer)
        scale = 1.0 if positions is None else optimizer_variables[positions[0]]
        return seen, self.names, [weight * scale for weight in self.weights]

    def add(self, held, outputs, samples, loss):
        """The sets and vector with one micro-batch's outputs added.

        Args:
            held: The sets and vector as they were (emptied where the window
                restarts), float32.
            outputs: `gradient_and_outputs`' `outputs`.
            samples: The micro-batch's samples (this device's share).
            loss: Its unscaled loss.
        """
        per_output = len(held[:-1]) // len(self.names)
        arrays = []
        for k, (grads, value, count) in enumerate(outputs):
            count = jnp.asarray(count, jnp.float32)
            sets = held[k * per_output:(k + 1) * per_output]
            arrays += [h + count * g.astype(jnp.float32) for h, g in zip(sets, grads)]
        return arrays + [held[-1] + self.counted(outputs, samples, loss)]

    def counted(self, outputs, samples, loss):
        """A micro-batch's entries of the counts' vector (as `add`'s arguments)."""
        counts = jnp.stack([jnp.asarray(c, jnp.float32) for _, _, c in outputs])
        values = jnp.stack([jnp.asarray(v, jnp.float32) for _, v, _ in outputs])
        rest = jnp.asarray(loss, jnp.float32) - jnp.sum(jnp.asarray(self.weights) * values)
        return jnp.concatenate([counts, counts * values,
                                jnp.reshape(rest * jnp.asarray(samples, jnp.float32), (1,))])

    def combine(self, grads, held, total):
        """`grads` (the main window's, normalised) plus each output's set over
        every device (`total`) divided by its count over the window."""
        per_output = len(held[:-1]) // len(self.names)
        vector = total(held[-1])
        grads = list(grads)
        for k in range(len(self.names)):
            divisor = output_weighting.divisor(vector[k], 1.0, jnp)
            for i, a in enumerate(held[k * per_output:(k + 1) * per_output]):
                grads[i] = grads[i] + total(a.astype(jnp.float32)) / divisor
        return grads

    def window_loss(self, held, total, samples):
        """The window's loss as the large batch's (`samples`: the window's)."""
        return self.loss(total(held[-1]), samples)

    def loss(self, vector, samples):
        """The loss of what a counts' `vector` holds, as the large batch's: the
        rest's, weighted by `samples`, plus each output's weighted mean over its
        count."""
        k = len(self.names)
        rest = vector[2 * k] / jnp.maximum(jnp.asarray(samples, jnp.float32), 1.0)
        return rest + output_weighting.window_loss(
            self.weights, [vector[k + i] for i in range(k)], [vector[i] for i in range(k)],
            1.0, jnp)

    def full_gradient(self, grads, outputs):
        """The micro-batch's whole gradient (the rest's plus each output's share)."""
        return [g + sum(shares[i] for shares, _, _ in outputs) for i, g in enumerate(grads)]
