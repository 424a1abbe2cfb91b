"""The hook's counts on TensorFlow: named int64 counters in one variable (`CounterVariable`)."""

import collections.abc

import tensorflow as tf

from tfaccum.backend.tensorflow.devices import assign_local
from tfaccum.backend.tensorflow.devices import local_values
from tfaccum.counts import REPLICA_SHARES
from tfaccum.counts import TOTAL_COUNTS
from tfaccum.counts import WINDOW_COUNTS


class CounterVariable:
    """Named int64 counters held in one variable.

    One variable, so that a micro-step updates everything it counts with one
    op; read and written by name. With several replicas each replica keeps
    its own vector (see `REPLICA_SHARES`): `numpy()` reads this machine's
    first replica, without talking to other workers, and `global_read()` sums
    the window's shares (a reduction: every replica takes part).

    Args:
        strategy: The model's `tf.distribute` strategy.
        names: The counts, in the order they are stored.
    """

    def __init__(self, strategy, names=WINDOW_COUNTS + TOTAL_COUNTS):
        self.names = tuple(names)
        self._index = {name: i for i, name in enumerate(self.names)}
        self._strategy = strategy
        self._replicas = strategy.num_replicas_in_sync
        self._shares = [name in REPLICA_SHARES for name in self.names]
        with tf.init_scope(), strategy.scope():
            self.variable = tf.Variable(
                tf.zeros((len(self.names),), tf.int64),
                trainable=False,
                name="accumulation_counts",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM,
            )

    def delta(self, **counts):
        """An int64 vector adding `counts` (by name) to the stored ones."""
        unknown = set(counts) - set(self._index)
        if unknown:
            raise KeyError(f"Unknown counts: {sorted(unknown)}")
        # Python ints alone make one constant; with tensors, one stacking op.
        entries = [0] * len(self.names)
        for name, value in counts.items():
            entries[self._index[name]] = (
                value if isinstance(value, int) else tf.cast(value, tf.int64))
        return tf.convert_to_tensor(entries, tf.int64)

    def add(self, delta):
        """Adds a vector made by `delta()`."""
        self.variable.assign_add(delta)

    def read(self, names=None):
        """The counts now, as `{name: int64 tensor}` (this replica's in a replica context).

        `names`: only these (all by default).
        """
        index = self._index if names is None else {name: self._index[name] for name in names}
        return _CountsRead(self.variable.read_value(), index)

    def global_read(self):
        """The counts with the window's shares summed over replicas (cross-replica).

        Read across replicas the variable sums every replica's vector: the
        shares are that sum, every other count is the same on each replica.
        """
        vector = self.variable.read_value()
        vector = tf.where(self._shares, vector, vector // self._replicas)
        return _CountsRead(vector, self._index)

    def local(self):
        """This machine's first replica's vector (the variable itself on one replica)."""
        return self._strategy.experimental_local_results(self.variable)[0]

    def numpy(self):
        """The counts now, as `{name: int}`: a local host read.

        With several replicas the window's `REPLICA_SHARES` are this
        replica's; the hook's `pending` gives the window's total.
        """
        vector = self.local().numpy()
        return {name: int(vector[i]) for i, name in enumerate(self.names)}

    def zero(self):
        self.variable.assign(tf.zeros_like(self.variable))

    def replica_numpy(self):
        """Each of this machine's replicas' counts, as `[{name: int}]` (host reads)."""
        return [{name: int(vector[i]) for i, name in enumerate(self.names)}
                for vector in local_values(self._strategy, self.variable)]

    def set_replicas(self, counts):
        """Sets each of this machine's replicas' counts from `replica_numpy()`'s form."""
        assign_local(self._strategy, self.variable,
                     [[values[name] for name in self.names] for values in counts])


class _CountsRead(collections.abc.Mapping):
    """One read of the counts, `{name: int64 tensor}`, unstacked when first asked for.

    One op gives them all: a slice per count would add four graph nodes (a
    `StridedSlice` and its three constants) per count the window's end reads.
    """

    def __init__(self, vector, index):
        self._vector = vector
        self._index = index
        self._counts = None

    def __getitem__(self, name):
        if self._counts is None:
            self._counts = tf.unstack(self._vector, num=self._vector.shape[0])
        return self._counts[self._index[name]]

    def __iter__(self):
        return iter(self._index)

    def __len__(self):
        return len(self._index)
