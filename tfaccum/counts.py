"""The hook's counts: named int64 counters in one variable.

The `window_*` counts describe the open window and go back to zero when it
ends; the others count since the hook was installed.
"""

import collections.abc
import dataclasses

import tensorflow as tf

# The counts a hook keeps. The `window_*` ones describe the open window and
# go back to zero when it ends; the others count since the hook was installed.
# `window_items`: what the window's gradient is divided by under
# reduction="auto": its samples, or the unmasked elements its losses averaged.
WINDOW_COUNTS = (
    "window_micro_batches",
    "window_samples",
    "window_items",
    "window_nonfinite",
)
TOTAL_COUNTS = (
    "samples",
    "items",
    "micro_steps",
    "optimizer_steps",
    "flushes",
    "dropped_micro_steps",
    "nonfinite_skips",
)
# With several replicas every replica keeps every count (the same on each),
# except the open window's samples, items and shares left out (non-finite):
# each replica's own, summed when the window is reduced at its end. Their
# totals are then added from the reduced window, so every count reads locally.
REPLICA_SHARES = ("window_samples", "window_items", "window_nonfinite")


class Counts:
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


class _CountsRead(collections.abc.Mapping):
    """One read of the counts, `{name: int64 tensor}`, unstacked when first asked for.

    One op gives them all, where a slice per count took four graph nodes (a
    `StridedSlice` and its three constants): the window's end, which reads
    most of them, has 73 nodes fewer (benchmarks/step_ops.py).
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


@dataclasses.dataclass(frozen=True)
class Counters:
    """A hook's counters at one moment: one read from the device serves them all.

    Integers counted since the hook was installed (for the callback: over the
    last `fit`).

    Attributes:
        micro_steps: Micro-batches trained on.
        optimizer_steps: Optimizer updates made.
        flushes: Partial windows applied by `flush()` (at an epoch's or
            `fit`'s end).
        dropped_micro_steps: Micro-batches discarded by `drop()`
            (`leftover="drop"`).
        nonfinite_skips: Micro-batches left out for non-finite gradients.
        samples: Samples whose gradients joined a window.
        items: What their losses averaged over: equal to `samples`, or the
            unmasked elements (tokens) where masks or `ignore_class` reach the
            loss; windows are weighted in this unit (`reduction="auto"`).
    """

    micro_steps: int = 0
    optimizer_steps: int = 0
    flushes: int = 0
    dropped_micro_steps: int = 0
    nonfinite_skips: int = 0
    samples: int = 0
    items: int = 0

    @classmethod
    def read(cls, counts):
        """The counters of `counts` (a `Counts`), read once."""
        values = counts.numpy()
        return cls(**{field.name: values[field.name] for field in dataclasses.fields(cls)})


def with_counter_properties(cls):
    """Class decorator: a read-only property per `Counters` field, read from the
    class's `counters` snapshot (`hook.micro_steps` is `hook.counters.micro_steps`)."""
    for field in dataclasses.fields(Counters):
        setattr(cls, field.name, property(
            lambda self, name=field.name: getattr(self.counters, name),
            doc=f"`counters.{field.name}` (see `tfaccum.counts.Counters`)."))
    return cls
