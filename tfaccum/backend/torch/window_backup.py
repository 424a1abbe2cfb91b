"""The PyTorch hook's open window as host arrays, and back: what a backup holds of it.

The accumulators are stored as float32 (a bfloat16 sum converts exactly).
PyTorch's global generator goes with them: Keras' unseeded dropout draws
from it on this backend, and so does bfloat16's stochastic rounding.
"""

import keras
import numpy as np
import torch

from tfaccum import window_state
from tfaccum.backend.torch.step import Accumulators

DEVICE_COUNTS = "device_counts"
RANDOM = "torch_random_state"
ACCUMULATOR = "accumulator/"


def refusal(hook):
    """What this hook cannot hold mid-window, or `None`."""
    if hook._channels is not None:
        return "outputs whose items are counted apart (each output's own sums)"
    return None


def read(hook):
    """The hook's window, counts and observers' states as `{name: numpy array}`."""
    entries = window_state.counts_entries(hook.counts.values)
    entries[DEVICE_COUNTS] = np.array(hook.counts.on_device)
    entries[RANDOM] = torch.get_rng_state().numpy()
    for index, sums in enumerate(hook._accumulators or ()):
        entries[f"{ACCUMULATOR}{index}"] = sums.detach().float().cpu().numpy()
    entries.update(window_state.observer_entries(hook, _numpy))
    return entries


def restore(hook, state):
    """Sets what `read` gave on `hook`, installed by a new `fit` before its first micro-step."""
    variables = hook.model.trainable_weights
    if hook._observed is None:
        hook._observed = [observer.initial() for observer in hook.observers]
    expected = {DEVICE_COUNTS: hook.counts.on_device.shape}
    expected.update({name: () for name in window_state.counts_entries(hook.counts.values)})
    expected.update({f"{ACCUMULATOR}{i}": tuple(v.shape) for i, v in enumerate(variables)})
    expected.update({name: value.shape for name, value in window_state.observer_entries(
        hook, _numpy).items()})
    expected[RANDOM] = torch.get_rng_state().shape
    window_state.check_fits(expected, state)
    hook.counts.values.update(window_state.counts_of(state))
    hook.counts.on_device = np.array(state[DEVICE_COUNTS], np.int64)
    if RANDOM in state:
        torch.set_rng_state(torch.from_numpy(np.array(state[RANDOM], np.uint8)))
    if f"{ACCUMULATOR}0" in state:
        accumulators = Accumulators(variables, hook.configuration.accumulator_dtype)
        with torch.no_grad():
            for index, sums in enumerate(accumulators):
                sums.copy_(torch.from_numpy(np.array(state[f"{ACCUMULATOR}{index}"])))
        hook._accumulators = accumulators
    window_state.restore_observers(hook, state, _tensor)


def _numpy(value):
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def _tensor(value):
    return keras.ops.convert_to_tensor(np.asarray(value))  # the observers' namespace
