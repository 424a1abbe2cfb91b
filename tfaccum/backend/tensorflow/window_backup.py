"""The open window as a backup holds it: a hook's state as named host arrays.

`AccumulationHook.window_state()` reads it between micro-steps and
`restore_window_state()` sets it on the hook a resumed `fit` installed,
before its first micro-step (`tfaccum.window_state` has what every backend
shares: the counts' and observers' entries, the check that a state fits).
Besides those, a TensorFlow hook's entries are:

- `window/accumulation_steps`: the window's length;
- `window/rounding_seed`: what bfloat16 accumulators' roundings draw from
  (`precision.RoundingSeeds`; the micro-step's number is in the counts);
- `window/loss_sum`: the window's loss sums (`Accumulators.loss_sum`);
- `window/accumulator/<i>`: the window's gradient sum of the model's `i`-th
  trainable variable (bfloat16 as float32), while the window holds any.

`counts/<name>` are the hook's counts, the window's `REPLICA_SHARES` summed
over replicas. With several replicas each keeps its own window:
`replica_<r>/window/loss_sum`, `replica_<r>/window/accumulator/<i>` and its
shares, `replica_<r>/counts/<share>`.
"""

import numpy as np
import tensorflow as tf

from tfaccum import window_state
from tfaccum.backend.tensorflow.batch_norm.moments import BatchNormWindows
from tfaccum.counts import REPLICA_SHARES
from tfaccum.counts import TOTAL_COUNTS
from tfaccum.counts import WINDOW_COUNTS

WINDOW = "window/"
STEPS = WINDOW + "accumulation_steps"
SEED = WINDOW + "rounding_seed"
LOSS_SUM = "loss_sum"
ACCUMULATOR = "accumulator/"


def refusal(hook):
    """What of `hook`'s window a backup cannot hold (a phrase), or `None`."""
    if hook.window_loss is not None:  # the window is each micro-batch's cached forward pass
        return "a window-wide loss (tfaccum.WindowLoss)"
    if any(isinstance(observer, BatchNormWindows) for observer in hook.observers):
        return "AccumBatchNormalization layers"  # their pooled moments are the layers'
    state = hook.state
    if state.channels is not None:
        return "outputs whose losses average over counts of their own (the window's channels)"
    return state.accumulators.backup_refusal({id(v) for v in _named(hook.model).values()})


def read(hook):
    """`hook`'s open window, counts and observers as `{name: numpy array}`.

    Raises:
        ValueError: The window holds something a backup cannot (`refusal`).
    """
    _check_holdable(hook, hook.counts.numpy()["window_micro_batches"])
    state = hook.state
    replicas = state.counts.replica_numpy()
    counts = dict(replicas[0], **{name: sum(own[name] for own in replicas)
                                  for name in REPLICA_SHARES})
    held = window_state.counts_entries(counts)
    held[STEPS] = np.asarray(state.steps.numpy(), np.int64)
    if state.accumulators.rounding is not None:
        held[SEED] = np.asarray(state.accumulators.rounding.variable.numpy(), np.int64)
    # An empty window's accumulators are zeros: left out.
    empty = counts["window_micro_batches"] == 0
    windows = state.accumulators.held({id(v): name for name, v in _named(hook.model).items()})
    for index, (own, window) in enumerate(zip(replicas, windows)):
        prefix = _replica(index, len(replicas))
        if prefix:
            held.update({prefix + window_state.COUNTS + name: np.asarray(own[name], np.int64)
                         for name in REPLICA_SHARES})
        held.update({prefix + WINDOW + name: value for name, value in window.items()
                     if name == LOSS_SUM or not empty})
    held.update(window_state.observer_entries(hook, _numpy))
    return held


def restore(hook, held):
    """Sets what `read()` gave on `hook` (installed, before its first micro-step).

    Raises:
        ValueError: `held` does not fit `hook` (nothing is changed then).
    """
    window_state.check_fits(_shapes(hook), held)
    replicas = _local_replicas(hook.state)
    required = [window_state.COUNTS + name for name in WINDOW_COUNTS + TOTAL_COUNTS] + [
        _replica(index, replicas) + window_state.COUNTS + name
        for index in range(replicas) if replicas > 1 for name in REPLICA_SHARES]
    missing = [name for name in required if name not in held]
    if missing:
        raise ValueError(
            f"The backup's open window does not fit this model's accumulation: it lacks "
            f"{missing}. Resume with the model, strategy and callback arguments the backup "
            "was taken with.")
    counts = window_state.counts_of(held)
    _check_holdable(hook, counts["window_micro_batches"])
    state = hook.state
    own_counts, windows = [], []
    for index in range(replicas):
        prefix = _replica(index, replicas) + WINDOW
        own_counts.append(dict(counts, **{
            name: int(held[_replica(index, replicas) + window_state.COUNTS + name])
            for name in REPLICA_SHARES if replicas > 1}))
        windows.append({name[len(prefix):]: value for name, value in held.items()
                        if name.startswith(prefix) and name not in (STEPS, SEED)})
    with hook.model.distribute_strategy.scope():
        state.counts.set_replicas(own_counts)
        state.accumulators.hold(_named(hook.model), windows)
        if STEPS in held:
            state.steps.assign(int(held[STEPS]))
        if SEED in held and state.accumulators.rounding is not None:
            state.accumulators.rounding.variable.assign(int(held[SEED]))
    window_state.restore_observers(hook, held, tf.convert_to_tensor)


def _shapes(hook):
    """`{name: shape}` of every entry `hook` could hold."""
    state = hook.state
    replicas = _local_replicas(state)
    shapes = {window_state.COUNTS + name: () for name in WINDOW_COUNTS + TOTAL_COUNTS}
    shapes[STEPS] = ()
    if state.accumulators.rounding is not None:
        shapes[SEED] = ()
    for index in range(replicas):
        prefix = _replica(index, replicas)
        if prefix:
            shapes.update({prefix + window_state.COUNTS + name: () for name in REPLICA_SHARES})
        shapes[prefix + WINDOW + LOSS_SUM] = (2,)
        shapes.update({prefix + WINDOW + name: tuple(variable.shape)
                       for name, variable in _named(hook.model).items()})
    shapes.update({name: np.shape(value)
                   for name, value in window_state.observer_entries(hook, _numpy).items()})
    return shapes


def _check_holdable(hook, micro_batches):
    """Raises where the window holds micro-batches a backup cannot hold."""
    refused = refusal(hook)
    if refused is not None and micro_batches > 0:
        raise ValueError(
            f"The open accumulation window holds {micro_batches} micro-batches of a model "
            f"with {refused}, which a backup cannot hold: back up where a window ends "
            "(`backup_refusal()` names it).")


def _named(model):
    """`{name: variable}` of the accumulators a backup may hold, named by each
    trainable variable's index: the same in every process that builds the
    model alike (its `path` is not: a process's second model gets other layer
    names)."""
    return {f"{ACCUMULATOR}{index}": variable
            for index, variable in enumerate(model.trainable_variables)}


def _replica(index, replicas):
    """The prefix of replica `index`'s entries (none on one)."""
    return f"replica_{index}/" if replicas > 1 else ""


def _local_replicas(state):
    return len(state.strategy.experimental_local_results(state.counts.variable))


def _numpy(value):
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value)
