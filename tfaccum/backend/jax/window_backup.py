"""The JAX hook's open window as host arrays, and back: what a backup holds of it.

The counts are the host's and the device's vector; the accumulators (one
entry per device under `DataParallel`) are stored as float32 (a bfloat16
sum converts exactly) and put back with the sharding the hook gives its
own; the stochastic rounding's seed goes with them, so that a resumed
window draws what it would have drawn.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tfaccum import window_state

DEVICE_COUNTS = "device_counts"
SEED = "rounding_seed"
ACCUMULATOR = "accumulator/"


def refusal(hook):
    """What this hook cannot hold mid-window, or `None`."""
    if hook.cached is not None:
        return "a window-wide loss (its cached window holds the micro-batches' inputs)"
    if hook._compiled.channels is not None:
        return "outputs whose items are counted apart (each output's own sums)"
    return None


def read(hook):
    """The hook's window, counts and observers' states as `{name: numpy array}`."""
    entries = window_state.counts_entries(hook.counts.values)
    entries[DEVICE_COUNTS] = np.asarray(hook.counts.on_device)
    entries[SEED] = np.asarray(hook._compiled.rounding.seed, np.int64)
    for index, sums in enumerate(hook._accumulators or ()):
        entries[f"{ACCUMULATOR}{index}"] = np.asarray(sums.astype(jnp.float32))
    entries.update(window_state.observer_entries(hook, np.asarray))
    return entries


def restore(hook, state):
    """Sets what `read` gave on `hook`, installed by a new `fit` before its first micro-step."""
    model, devices = hook.model, hook.devices
    trainable = [v.value for v in model.trainable_variables]
    made = [devices.zeros(v.shape, hook._compiled.rounding.dtype) for v in trainable]
    if hook._observed is None:
        hook._observed = tuple(observer.initial() for observer in hook.observers)
    expected = {DEVICE_COUNTS: hook.counts.on_device.shape, SEED: ()}
    expected.update({name: () for name in window_state.counts_entries(hook.counts.values)})
    expected.update({f"{ACCUMULATOR}{i}": a.shape for i, a in enumerate(made)})
    expected.update({name: value.shape for name, value in window_state.observer_entries(
        hook, np.asarray).items()})
    window_state.check_fits(expected, state)
    hook.counts.values.update(window_state.counts_of(state))
    hook.counts.on_device = _put(state[DEVICE_COUNTS], hook.counts.on_device)
    hook._compiled.rounding.seed = int(state[SEED])  # read when the step first traces
    if f"{ACCUMULATOR}0" in state:
        hook._accumulators = [_put(state[f"{ACCUMULATOR}{i}"], like)
                              for i, like in enumerate(made)]
    window_state.restore_observers(hook, state, jnp.asarray)
    # `optimizer.iterations` as the host counts it (the summaries' steps), restored before.
    hook._iterations = int(np.asarray(model.optimizer.iterations.value))


def _put(value, like):
    """`value` where `like` lives, in its dtype (each device's entry on its device)."""
    return jax.device_put(np.asarray(value).astype(like.dtype), like.sharding)
