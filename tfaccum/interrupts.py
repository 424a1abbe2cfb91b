"""Signals held while a step's donated buffers are in flight.

A compiled step that donates its inputs (JAX updates the model's state in
place) deletes them when it is dispatched; its outputs are the only copy
until they are assigned back. A `KeyboardInterrupt` raised between the two
would lose the model's weights. `deferred()` holds SIGINT (and SIGTERM where
a Python handler is installed for it) across that window, then delivers it
to the handler that was there before, so Ctrl-C still interrupts `fit`, one
step later.
"""

import contextlib
import signal
import threading

# Signals a Python handler may turn into an exception mid-step. SIGTERM's
# default handler ends the process, where the weights in memory do not matter.
_SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None))
                 if s is not None)


class _Deferral:
    """What one outermost `deferred()` holds: the handlers it replaced, the signals
    that arrived."""

    def __init__(self):
        self.depth = 0
        self.previous = {}
        self.arrived = []

    def hold(self, signum, frame):
        self.arrived.append(signum)

    def enter(self):
        self.depth += 1
        if self.depth > 1:
            return
        for signum in _SIGNALS:
            handler = signal.getsignal(signum)
            if callable(handler):  # a Python handler (Ctrl-C's is one)
                self.previous[signum] = handler
                signal.signal(signum, self.hold)

    def exit(self, before_delivery):
        self.depth -= 1
        if self.depth:
            return
        previous, self.previous = self.previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        arrived, self.arrived = self.arrived, []
        if arrived:
            before_delivery()
            for signum in dict.fromkeys(arrived):
                # The restored handler runs now: Ctrl-C's raises KeyboardInterrupt.
                signal.raise_signal(signum)


_DEFERRAL = _Deferral()


def _nothing():
    pass


@contextlib.contextmanager
def deferred(before_delivery=_nothing):
    """Holds SIGINT (and a Python-handled SIGTERM) until the block ends, then delivers it.

    Re-entrant; in a thread other than the main one (where no signal handler
    runs) it does nothing.

    Args:
        before_delivery: Called when the block completed and a signal
            arrived, before it is delivered (e.g. to write the step's outputs
            where the code the interrupt unwinds through reads them).

    Example:

    ```python
    with deferred():
        state = step(state)  # donates `state`; Ctrl-C waits for the assignment
    ```
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _DEFERRAL.enter()
    try:
        yield
    except BaseException:
        _DEFERRAL.exit(_nothing)  # the block's outputs are not there to write
        raise
    _DEFERRAL.exit(before_delivery)
