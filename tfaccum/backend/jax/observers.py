"""What watches the window on JAX: observers as state carried through the compiled steps.

An observer's device state is a small pytree of arrays that the compiled
steps take and return (donated with the accumulators): `on_micro_step` and
`on_apply` are pure functions of it, run inside the step; the host reads it
only when asked (`noise_scale`, a summary write). The estimates are
`tfaccum.noise_scale`'s, as on TensorFlow.
"""

import dataclasses

import jax.numpy as jnp

from tfaccum import dashboard_schema
from tfaccum import noise_scale


@dataclasses.dataclass(frozen=True)
class MicroStep:
    """One micro-batch, as observers see it inside the step.

    Attributes:
        squared_norm: Squared norm of the gradient of its mean loss.
        samples: Its samples (int32), in the unit the window weighs by.
        loss: Its loss (float32), as Keras logs it.
        sample_count: Its samples proper (int32): what its loss weighs in a
            window whose micro-batches counted no item.
    """

    squared_norm: object
    samples: object
    loss: object = None
    sample_count: object = None


@dataclasses.dataclass(frozen=True)
class Update:
    """A window's update, as observers see it inside the step.

    Attributes:
        squared_norm: Squared norm of the applied (normalised) gradient.
        variable_squares: Its squared norm per trainable variable, in order.
        samples: The window's samples (int32).
    """

    squared_norm: object
    variable_squares: list
    samples: object


class WindowObserver:
    """Base class of an observer on JAX: every method is optional.

    `initial()` is its device state; `on_micro_step(state, step)` and
    `on_apply(state, update)` return the next, inside the compiled step;
    `on_install(hook)`, `on_uninstall(hook)`, `on_reset()` and, after each
    update, `after_apply(iterations, window, counts)` run on the host.
    """

    reads_micro_batch_gradients = False

    def initial(self):
        return ()

    def on_micro_step(self, state, step):
        return state

    def on_apply(self, state, update):
        return state

    def on_install(self, hook):
        self.hook = hook

    def on_uninstall(self, hook):
        pass

    def on_reset(self):
        pass

    def after_apply(self, iterations, window, counts):
        pass

    def state(self):
        """This observer's device state now (from its hook)."""
        return self.hook.observer_state(self)


class NoiseScaleEstimator(WindowObserver):
    """The gradient noise scale B_simple from each window's micro-batch and window gradients.

    As TensorFlow's (`tfaccum.backend.tensorflow.observers`): within a
    window its micro-batches are the small batches (their sample-weighted
    squared norms), the window the big one; the two estimates are smoothed
    apart before dividing; a window of one micro-batch gives none.
    """

    reads_micro_batch_gradients = True

    def __init__(self):
        self.hook = None

    def __repr__(self):
        return f"NoiseScaleEstimator(noise_scale={self.noise_scale!r})"

    def initial(self):
        # `tfaccum.noise_scale`'s state, as device arrays.
        return {"micro": jnp.zeros(3, jnp.float32), "gradient_square": jnp.zeros(()),
                "trace": jnp.zeros(()), "micro_batch": jnp.zeros(()),
                "windows": jnp.zeros((), jnp.float32)}

    def on_micro_step(self, state, step):
        return dict(state, micro=state["micro"] + noise_scale.micro_batch_terms(
            step.squared_norm, jnp.asarray(step.samples, jnp.float32), jnp))

    def on_apply(self, state, update):
        return noise_scale.add_window(state, update.squared_norm,
                                      jnp.asarray(update.samples, jnp.float32), jnp)

    def on_reset(self):
        """A window dropped: what its micro-batches added goes (on the host's copy)."""
        if self.hook is not None and self.hook.observer_state(self) is not None:
            self.hook.set_observer_state(self, dict(self.state(), micro=jnp.zeros(3)))

    def restart(self):
        """Forgets every estimate (a new `fit` of a new callback)."""
        if self.hook is not None:
            self.hook.set_observer_state(self, self.initial())

    def current(self):
        """B_simple now as a device scalar, NaN while it is not defined (no read)."""
        return noise_scale.current(self.state(), jnp)

    @property
    def noise_scale(self):
        """B_simple, or `None` until a window with two micro-batches gave one."""
        state = None if self.hook is None else self.state()
        if state is None or int(state["windows"]) == 0 or float(state["gradient_square"]) <= 0:
            return None
        return float(state["trace"] / state["gradient_square"])

    @property
    def micro_batch_size(self):
        state = None if self.hook is None else self.state()
        return None if state is None else (float(state["micro_batch"]) or None)

    def suggested_accumulation_steps(self):
        """`accumulation_steps` whose effective batch is closest to B_simple (the dashboard's rule)."""
        return dashboard_schema.suggested_accumulation_steps(self.noise_scale,
                                                             self.micro_batch_size)
