"""The open window as named host arrays: what a backup holds of a hook.

Every backend's hook has `window_state()` (a `{name: numpy array}` read
between micro-steps) and `restore_window_state(state)` (on the hook a
resumed `fit` installed, before its first micro-step). What they share is
here: the names, the counters' entries, the observers' entries and the check
that a state fits the hook it is given to.
"""

import numpy as np

from tfaccum.counts import TOTAL_COUNTS
from tfaccum.counts import WINDOW_COUNTS

COUNTS = "counts/"
OBSERVER = "observer/"


def counts_entries(values):
    """The host counts `{name: int}` as entries (`counts/<name>`)."""
    return {COUNTS + name: np.asarray(values[name], np.int64)
            for name in WINDOW_COUNTS + TOTAL_COUNTS if name in values}


def counts_of(state):
    """The counts a state holds, as `{name: int}`."""
    return {key[len(COUNTS):]: int(value) for key, value in state.items()
            if key.startswith(COUNTS)}


def observer_entries(hook, to_numpy):
    """Each observer's state (`observer/<index>/<class>/<key>`), but where its
    class says `backed_up = False`. The dashboard's is its open window's
    micro-batch norms; the rows it buffers are written before a backup."""
    entries = {}
    for prefix, observer in _backed_up(hook):
        for key, value in (observer.state() or {}).items():
            entries[prefix + key] = np.asarray(to_numpy(value))
    return entries


def restore_observers(hook, state, to_backend):
    """Sets each backed-up observer's state from `state` (after `hook` made its own)."""
    for prefix, observer in _backed_up(hook):
        entries = {key[len(prefix):]: to_backend(value) for key, value in state.items()
                   if key.startswith(prefix)}
        if entries:
            hook.set_observer_state(observer, entries)


def _backed_up(hook):
    return [(f"{OBSERVER}{index}/{type(observer).__name__}/", observer)
            for index, observer in enumerate(hook.observers)
            if getattr(observer, "backed_up", True)]


def check_fits(expected, state):
    """Raises a `ValueError` naming the first entry of `state` that this hook
    has no place for, or whose shape differs from its place's (`expected`:
    `{name: shape}` of every entry the hook could hold; an empty window holds
    no accumulators)."""
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ValueError(
            "The backup's open window does not fit this model's accumulation: it holds "
            f"{extra}, which this one has no place for. Resume with the model, compile() "
            "and callback arguments the backup was taken with.")
    for name, value in state.items():
        if tuple(np.shape(value)) != tuple(expected[name]):
            raise ValueError(
                f"The backup's open window does not fit this model: {name!r} has shape "
                f"{tuple(np.shape(value))}, this model's {tuple(expected[name])}. Resume "
                "with the model the backup was taken with.")
