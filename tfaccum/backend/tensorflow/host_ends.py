"""Window ends the host asks for: `flush()`, `drop()` and reading what is pending.

Each runs a graph of the devices' (`flush_graph`, `drop_graph`,
`pending_graph`) outside the train step: on one device op by op the first
`EAGER_HOST_ENDS` times, then traced once and reused.
"""

import tensorflow as tf

from tfaccum import interrupts
from tfaccum.counts import Window

# On one device, a hook's first flushes and drops run eagerly (see `HostEnds.run`).
EAGER_HOST_ENDS = 2


class HostEnds:
    """Ends or reads a hook's open window from the host.

    Args:
        model: The compiled model.
        devices: The hook's `OneDevice` or `SeveralDevices`.
    """

    def __init__(self, model, devices):
        self.model = model
        self.devices = devices
        self._functions = {}
        self._runs = {}

    def run(self, name, graph):
        """Runs `graph` as a `Window`: eagerly, or compiled once.

        On one device the first `EAGER_HOST_ENDS` runs of each graph are
        eager: a flush happens once an epoch, and tracing the window's end
        (the optimizer's update, the observers) costs more than running it
        op by op once or twice, so a short `fit` never pays for the trace.
        Later runs are compiled once.
        """
        runs = self._runs[name] = self._runs.get(name, 0) + 1
        if self.model.run_eagerly or (
                self.devices.ends_eagerly and runs <= EAGER_HOST_ENDS):
            function = graph
        else:
            if name not in self._functions:
                self._functions[name] = tf.function(graph, autograph=False)
            function = self._functions[name]
        # Op by op, an interrupt between two ops would leave half a window's
        # end (the update made, the window still counted): it waits.
        with interrupts.deferred(), self.model.distribute_strategy.scope():
            micro_batches, samples = function()
        return Window(int(micro_batches), int(samples))

    def pending(self):
        """The open window as a `Window` (summed over replicas)."""
        return self.devices.pending(self.run)

    def flush(self):
        """Applies the open window, if any; the `Window` applied."""
        if not self._anything_pending():
            return Window(0, 0)
        return self.run("flush", self.devices.flush_graph)

    def drop(self):
        """Discards the open window, if any; the `Window` discarded."""
        if not self._anything_pending():
            return Window(0, 0)
        return self.run("drop", self.devices.drop_graph)

    def _anything_pending(self):
        # A host read of the counts: an empty window (an epoch that ended on
        # a window's end) neither traces nor runs the window-end graph.
        # Every worker reads the same total, so all skip it or none.
        return self.devices.traced and self.pending().micro_batches > 0
