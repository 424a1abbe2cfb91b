"""A window as one compiled program, where `steps_per_execution` allows it (JAX).

With `steps_per_execution` a multiple of `accumulation_steps`, a window that
begins an execution runs its micro-steps in a loop (`lax.scan`) and then its
update, in one jit, as hand-written JAX accumulates. Each micro-step is the
compiled step's own (`CompiledSteps`: `_accumulate`, `_normalize`, `_apply`),
so the result is the micro-step path's.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tfaccum.backend.jax import _keras_on_jax
from tfaccum.backend.jax.step import STEP


class WindowProgram:
    """The hook's windows compiled whole (a part the JAX hook composes).

    Args:
        hook: The JAX `AccumulationHook`.
    """

    def __init__(self, hook):
        self.hook = hook
        self.steps = hook._compiled
        self.run = (jax.jit(self._window, donate_argnums=(0, 1, 2)) if self.steps.jit
                    else self._window)

    def serves(self):
        """Whether this execution's windows run as one compiled program each.

        Where `steps_per_execution` is a multiple of `accumulation_steps` and
        an execution begins with the window empty, on one device; after the
        first update (the first steps trace one by one, so that a refusal
        leaves a plain model), where no step says a tensor count (each is
        checked before its window is applied), and where no observer (the
        noise scale, the dashboard) takes each micro-batch's gradient norm:
        inside the compiled loop that read held 1.6 parameter bytes more and
        cost a fifth of plain's epoch on the CPU (`benchmarks/jax_backend.py`).
        """
        hook = self.hook
        values = hook.counts.values
        return (hook.model.steps_per_execution % hook.accumulation_steps == 0
                and values["window_micro_batches"] == 0 and values["optimizer_steps"] > 0
                and hook.devices.shares == 1 and not self.steps.says_counts
                and not hook.observers and hook.cached is None)

    def execution(self, state, batches):
        """`steps_per_execution` micro-batches (`batches`, an iterator), a window at a
        time; a window the data ends inside, or of micro-batches of different
        shapes, one by one."""
        hook, length = self.hook, self.hook.accumulation_steps
        logs = None
        for _ in range(hook.model.steps_per_execution // length):
            batch = []
            for _ in range(length):
                try:
                    batch.append(next(batches))
                except StopIteration:
                    break
            if not batch:
                if logs is None:
                    raise StopIteration
                break
            shapes = {tuple(np.shape(leaf) for leaf in jax.tree.leaves(data)) for data in batch}
            if len(batch) < length or len(shapes) > 1:
                for data in batch:
                    logs, state = hook._interruptible_step(state, data)
                break
            logs, state = hook._interruptible_step(state, batch, self.step)
        return logs, state

    def step(self, state, batch):
        """A full window (`batch`: its micro-batches) as one compiled program."""
        hook = self.hook
        samples = _keras_on_jax.batch_size(batch[0])
        stack = np.stack if all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(
            batch)) else jnp.stack
        stacked = jax.tree.map(lambda *leaves: stack(leaves), *batch)
        counts, steps = hook.counts, len(batch)
        # Freed: the window makes its own (`_window`) and lets them go when it
        # ends; a micro-step makes new ones when it needs them.
        hook._accumulators = None
        (logs, state, hook._observed, counts.on_device, window, contributing) = self.run(state, hook._observed, counts.on_device, stacked,
                                  hook._window_vector(), jnp.asarray(samples, jnp.int32))
        counts.add(micro_steps=steps, samples=steps * samples, window_micro_batches=steps,
                   window_samples=steps * samples)
        hook._ended(window, contributing, state[2])
        return logs, state

    def _window(self, state, observed, counted, stacked, window, samples):
        """A window's micro-batches (`stacked` along a first axis, each of `samples`)
        added one after the other in a loop, then normalised and applied, as
        `accumulate`, `normalize` and `apply` do them one call at a time.

        The accumulators are made here, empty, and not returned: passed in,
        the loop would start from a copy of them (the hook lets go of its own
        first); returned, they would be held beside the updated variables.

        Args:
            window: The window vector before it (empty: the micro-step's
                number only, `STEP`).

        Returns:
            The last micro-step's logs, the state, the observers' states, the
            device's counts, the window's counts and whether it was applied.
        """
        steps = jax.tree.leaves(stacked)[0].shape[0]
        trainable, non_trainable, optimizer_variables, metrics = state
        accumulators = self.steps.new_accumulators(state)
        # The loop carries what a micro-step changes; the weights (and the
        # optimizer's state, but for a loss scale a micro-batch left out
        # lowers) are read as they are, not copied into the loop's state.
        carries_optimizer = self.steps.loss_scale is not None

        def add(carry, item):
            data, k = item
            non_trainable, metrics, optimizer, accumulators, observed, counted = carry
            optimizer = optimizer if carries_optimizer else optimizer_variables
            open_window = window.at[0].set(k).at[1].set(k * samples).at[STEP].add(k)
            logs, state, accumulators, observed, counted, _ = self.steps._accumulate(
                (trainable, non_trainable, optimizer, metrics), accumulators, observed,
                counted, data, open_window, samples)
            optimizer = state[2] if carries_optimizer else ()
            return (state[1], state[3], optimizer, accumulators, observed, counted), logs

        carry = (non_trainable, metrics, optimizer_variables if carries_optimizer else (),
                 accumulators, observed, counted)
        carry, logs = jax.lax.scan(add, carry, (stacked, jnp.arange(steps, dtype=jnp.int32)))
        non_trainable, metrics, optimizer, accumulators, observed, counted = carry
        if carries_optimizer:
            optimizer_variables = optimizer
        end = window.at[0].set(steps).at[1].set(steps * samples).at[STEP].add(steps)
        accumulators, observed, counted, counts, contributing = self.steps._normalize(
            accumulators, observed, counted, end)
        trainable, optimizer_variables = self.steps._apply(
            trainable, optimizer_variables, accumulators, contributing)
        logs = jax.tree.map(lambda value: value[-1], logs)
        return (logs, (trainable, non_trainable, optimizer_variables, metrics), observed,
                counted, counts, contributing)
