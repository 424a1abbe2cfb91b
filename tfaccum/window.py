"""The accumulation window: what has been added since the last update.

`WindowState` is the window a hook holds: the accumulators
(`AccumulationWindow`: one per variable that received a gradient), one more
window per output that counts differently (`OutputChannels`), the `Counts`,
the window's length and its `Reduction`; it alone adds a micro-batch, leaves
one out, says whether it is full, reads its counts, normalises and resets.
Everything here runs inside the compiled train step.
"""

import collections.abc
import warnings

import tensorflow as tf

from tfaccum import precision
from tfaccum import reduction as _reduction
from tfaccum import replication as _replication
from tfaccum.observers import MicroStep

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


class _DenseAccumulator:
    """Sums gradients into a tensor of the variable's shape."""

    def __init__(self, variable, synchronization, aggregation, dtype=None):
        self.variable = tf.Variable(
            tf.zeros(variable.shape, dtype or _accumulator_dtype(variable)),
            trainable=False,
            name="accumulated_gradient",
            synchronization=synchronization,
            aggregation=aggregation,
        )

    def add(self, grad, weight):
        dtype = self.variable.dtype
        if isinstance(grad, tf.IndexedSlices):
            values = tf.cast(grad.values, dtype)
            if weight is not None:
                values = values * tf.cast(weight, dtype)
            # On the handle: a variable kept per replica (ON_READ) has no
            # `scatter_add` of its own.
            tf.raw_ops.ResourceScatterAdd(
                resource=self.variable.handle, indices=grad.indices, updates=values
            )
        elif weight is not None:
            # accumulator -= (-weight) * grad, in one fused kernel.
            tf.raw_ops.ResourceApplyGradientDescent(
                var=self.variable.handle,
                alpha=-tf.cast(weight, dtype),
                delta=tf.cast(grad, dtype),
            )
        else:
            self.variable.assign_add(tf.cast(grad, dtype))

    def read(self):
        return self.variable.read_value()

    def scale(self, factor):
        self.variable.assign(self.variable * tf.cast(factor, self.variable.dtype))

    def reset(self):
        # Zeros made from the shape, not `zeros_like(variable)`: reading the
        # variable for it kept half a parameter copy more alive at the peak
        # (benchmarks/memory.py: 1.56 -> 1.07 parameter bytes).
        self.variable.assign(tf.zeros(self.variable.shape, self.variable.dtype))

    def forget(self):
        """Empties the accumulator where that is rare (inside a `tf.cond`).

        Subtracting what it holds, in place: zeros made inside the branch
        were allocated on every step, taken or not (1.0 parameter bytes of
        peak memory for the `cond` of `WindowState._forget_uncounted`). A
        non-finite sum stays non-finite.
        """
        self.variable.assign_sub(self.variable.read_value())

    def nbytes(self):
        return _nbytes(self.variable)


def _nbytes(variable):
    """Bytes `variable` holds now (a host read for a variable of varying shape)."""
    return int(tf.size(variable)) * variable.dtype.size


class _BFloat16Accumulator(_DenseAccumulator):
    """A dense accumulator in bfloat16, summed as `precision.BFloat16Sum` does."""

    def __init__(self, variable, synchronization, aggregation, dtype=tf.bfloat16):
        super().__init__(variable, synchronization, aggregation, dtype=dtype)
        self._sum = precision.BFloat16Sum(self.variable)

    def add(self, grad, weight):
        self._sum.add(grad, weight)

    def read(self):
        return self._sum.read()

    def scale(self, factor):
        self._sum.scale(factor)

    def reset(self):
        self._sum.zero()


class _RowAccumulator:
    """Keeps a sparse gradient's rows: the window's `IndexedSlices`, concatenated.

    The large batch's gradient of an embedding is one `IndexedSlices` holding
    a row per looked-up token; the window's is the concatenation of its
    micro-batches' rows, each weighted. Optimizers that treat rows one by one
    (Keras' Adam and Adagrad square each row before summing repeated ones)
    then update as for the large batch. Holds the rows of the open window:
    `rows x row size` values, against `variable rows x row size` for a
    dense accumulator.
    """

    def __init__(self, variable, synchronization, aggregation):
        dtype = _accumulator_dtype(variable)
        row_shape = tuple(variable.shape[1:])
        self.dense_shape = tf.constant(variable.shape, tf.int64)
        options = dict(
            trainable=False, synchronization=synchronization, aggregation=aggregation
        )
        self.indices = tf.Variable(
            tf.zeros((0,), tf.int64),
            shape=tf.TensorShape([None]),
            name="accumulated_rows_indices",
            **options,
        )
        self.values = tf.Variable(
            tf.zeros((0,) + row_shape, dtype),
            shape=tf.TensorShape((None,) + row_shape),
            name="accumulated_rows",
            **options,
        )

    def add(self, grad, weight):
        values = tf.cast(grad.values, self.values.dtype)
        if weight is not None:
            values = values * tf.cast(weight, values.dtype)
        indices = tf.cast(grad.indices, tf.int64)
        self.indices.assign(tf.concat([self.indices, indices], 0))
        self.values.assign(tf.concat([self.values, values], 0))

    def read(self):
        return tf.IndexedSlices(
            self.values.read_value(), self.indices.read_value(), self.dense_shape
        )

    def scale(self, factor):
        self.values.assign(self.values * tf.cast(factor, self.values.dtype))

    def reset(self):
        self.indices.assign(tf.zeros((0,), tf.int64))
        self.values.assign(tf.zeros_like(self.values[:0]))

    forget = reset  # the rows are the window's only

    def nbytes(self):
        return _nbytes(self.indices) + _nbytes(self.values)


class AccumulationWindow:
    """The accumulators of an open window and the hook's counts.

    Args:
        strategy: The model's `tf.distribute` strategy; with several replicas
            each replica accumulates its own share and the optimizer sums them.
        sparse_rows: Keep sparse (`IndexedSlices`) gradients as rows, so that
            the optimizer receives the window's rows as one `IndexedSlices`
            (as the large batch gives it). `False` scatter-adds them into a
            dense accumulator and hands the optimizer a dense gradient.
        dtype: The dense accumulators' dtype: `None` for the variable's
            (float32; float64 for float64), or `tf.bfloat16` (summed in
            float32 each micro-step and rounded stochastically,
            `precision.BFloat16Sum`). Row accumulators stay float32.
    """

    def __init__(self, strategy, *, sparse_rows=True, dtype=None):
        self.strategy = strategy
        self.sparse_rows = sparse_rows
        self.dtype = dtype
        self.counts = Counts(strategy)
        self._accumulators = {}  # id(variable) -> accumulator
        # Made ahead of the first trace (`create_dense(provisional=True)`),
        # kept once a traced step shows each gets a dense gradient.
        self._provisional = set()
        self._provisional_rows = {}  # id(variable) -> _RowAccumulator, made ahead
        with tf.init_scope(), strategy.scope():
            # The window's micro-batch losses, each times its items and
            # each times its samples (for a window of no items at all).
            self.loss_sum = tf.Variable(
                tf.zeros((2,), tf.float64),
                trainable=False,
                name="window_loss_sum",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM,
            )
        # What the train step applies: its variables, and which of them get
        # a gradient. Fixed when the step is traced.
        self.variables = None
        self.present = None
        self._variable_options = _replication.variable_options(strategy)

    @property
    def traced(self):
        """Whether a train step has told the window what it applies."""
        return self.variables is not None

    def track(self, grads, variables):
        """Records what a step applies; makes the accumulators it needs.

        Called while the step traces. Raises if a variable's gradient changes
        between sparse and dense after its accumulator was made.
        """
        self.variables = list(variables)
        self.present = [grad is not None for grad in grads]
        used = set()
        for grad, variable in zip(grads, variables):
            if grad is not None:
                self._accumulator(variable, isinstance(grad, tf.IndexedSlices))
                used.add(id(variable))
        for key in self._provisional - used:  # made ahead, but the step gives it nothing
            del self._accumulators[key]
        self._provisional.clear()
        self._provisional_rows.clear()  # those the step did not take

    def create_dense(self, variables, provisional=False):
        """Makes dense accumulators for `variables` now (outside any step).

        `provisional`: made ahead of the step's first trace, so that it makes
        no variable and traces once; the trace replaces one whose variable
        gets sparse rows, and drops one whose variable gets no gradient.
        """
        for variable in variables:
            if id(variable) not in self._accumulators and provisional:
                self._provisional.add(id(variable))
            self._accumulator(variable, sparse=False)

    def create_rows(self, variables):
        """Makes row accumulators for `variables` now, beside their dense ones.

        For the variables a step will probably give sparse gradients
        (embedding tables), made ahead of its first trace with
        `create_dense(provisional=True)`: the trace keeps whichever the
        gradient needs, so it makes no variable either way. Rows start
        empty (a few bytes).
        """
        if not self.sparse_rows:
            return
        for variable in variables:
            key = id(variable)
            if key in self._provisional and key not in self._provisional_rows:
                self._provisional_rows[key] = self._new_accumulator(variable, rows=True)

    def _accumulator(self, variable, sparse):
        key = id(variable)
        rows = sparse and self.sparse_rows
        accumulator = self._accumulators.get(key)
        if key in self._provisional and rows:
            self._provisional.discard(key)
            accumulator = self._provisional_rows.pop(key, None)
        if accumulator is None:
            accumulator = self._new_accumulator(variable, rows)
        self._accumulators[key] = accumulator
        return accumulator

    def _new_accumulator(self, variable, rows):
        with tf.init_scope(), self.strategy.scope():
            if rows:  # rows stay float32: they hold only the window's looked-up rows
                return _RowAccumulator(variable, *self._variable_options)
            cls = _BFloat16Accumulator if self.dtype == tf.bfloat16 else _DenseAccumulator
            return cls(variable, *self._variable_options, dtype=self.dtype)

    def has_accumulator(self, variable):
        return id(variable) in self._accumulators

    def uses_rows(self, variable):
        return isinstance(self._accumulators.get(id(variable)), _RowAccumulator)

    def add(self, grads, variables, weight=None, loss=None, items=None, samples=None):
        """Adds a micro-batch's gradients, each multiplied by `weight` if given.

        `loss` (its mean loss, if known) is added times `items` and times
        `samples`, for the window's loss (see `loss()`).
        """
        for grad, variable in zip(grads, variables):
            if grad is not None:
                self._accumulators[id(variable)].add(grad, weight)
        if loss is not None:
            counts = tf.cast(tf.stack([items, 0 if samples is None else samples]), tf.float64)
            self.loss_sum.assign_add(tf.cast(loss, tf.float64) * counts)

    def clear_gradients(self):
        """Empties the accumulators only (counts and losses stay)."""
        for accumulator in self._accumulators.values():
            accumulator.reset()

    def forget_gradients(self):
        """`clear_gradients()` for a rarely taken branch of the step (see `forget`)."""
        for accumulator in self._accumulators.values():
            accumulator.forget()

    def gradients(self, denominator=None):
        """The window's gradients for `self.variables`, divided by `denominator`.

        Dense accumulators give tensors, row accumulators `IndexedSlices`;
        `None` where the step gives a variable no gradient.
        """
        grads = []
        for variable, present in zip(self.variables, self.present):
            if not present:
                grads.append(None)
                continue
            grad = self._accumulators[id(variable)].read()
            if denominator is not None:
                grad = _divide(grad, denominator)
            grads.append(_cast(grad, variable.dtype))
        return grads

    def scale(self, factor):
        """Multiplies what the window holds by `factor` (a loss scale change)."""
        for accumulator in self._accumulators.values():
            accumulator.scale(factor)

    def reset(self):
        """Empties the accumulators (the counts are the caller's to adjust)."""
        self.clear_gradients()
        self.loss_sum.assign(tf.zeros_like(self.loss_sum))

    def nbytes(self):
        """Bytes the accumulators hold now (on this machine, for one replica)."""
        with tf.init_scope():
            return sum(a.nbytes() for a in self._accumulators.values())

    def zero(self):
        """Empties the accumulators and zeroes every count."""
        self.reset()
        self.counts.zero()


class OutputChannels:
    """One more window per output whose loss averages over a count of its own.

    A model whose outputs are masked differently (a per-token head and a
    per-sequence head) divides each output's loss by its own count; the large
    batch divides each by its window total. One weight per micro-batch cannot
    do that: each such output's gradient is accumulated here, weighted by its
    count and divided by its window's total, and the hook's main window keeps
    the rest (outputs that count samples, regularization), weighted by samples.
    Memory: one more accumulator per variable per such output.

    With several replicas each replica accumulates its share of each output,
    and the outputs' totals and loss sums over all replicas (`global_read()`,
    cross-replica, with the window's counts) divide them.

    Args:
        strategy: The model's `tf.distribute` strategy.
        names: The outputs' names, in the order their gradients come.
        weights: Their `loss_weights` entries (`None` for 1).
        sparse_rows: As `AccumulationWindow`'s.
        loss_share: What Keras multiplies each replica's losses by (see
            `_keras.replica_loss_share`).
    """

    def __init__(self, strategy, names, weights, *, sparse_rows=True, loss_share=1.0,
                 dtype=None):
        self.names = list(names)
        self.weights = [1.0 if w is None else float(w) for w in weights]
        self.windows = [AccumulationWindow(strategy, sparse_rows=sparse_rows, dtype=dtype)
                        for _ in names]
        self._loss_share = loss_share

    def track(self, grads_per_output, variables):
        for window, grads in zip(self.windows, grads_per_output):
            window.track(grads, variables)

    def add(self, grads_per_output, variables, counts, values):
        """Adds each output's gradient times its count (its loss as a sum)."""
        for window, grads, count, value in zip(self.windows, grads_per_output, counts, values):
            window.add(grads, variables, count, loss=value, items=count)
            window.counts.add(window.counts.delta(window_items=count))

    def global_read(self):
        """Each output's count and loss sum over every replica (cross-replica)."""
        return {
            "channel_items": [w.counts.global_read()["window_items"] for w in self.windows],
            "channel_loss_sums": [w.loss_sum.read_value()[0] for w in self.windows],
        }

    def _totals(self, totals):
        if totals is None:  # this replica's (all of them, on one)
            totals = [window.counts.read()["window_items"] for window in self.windows]
        return [tf.maximum(tf.cast(total, tf.float64), 1.0) for total in totals]

    def combine(self, grads, totals=None):
        """`grads` (the main window's, normalised) plus each output's, normalised.

        `totals`: each output's count over the window (`global_read()`'s), by
        default this replica's.
        """
        for window, total in zip(self.windows, self._totals(totals)):
            grads = [_add(a, b) for a, b in zip(grads, window.gradients(total * self._loss_share))]
        return grads

    def loss(self, totals=None, loss_sums=None):
        """The outputs' part of the window's loss: each weighted mean over its total."""
        if loss_sums is None:
            loss_sums = [window.loss_sum.read_value()[0] for window in self.windows]
        return tf.add_n([
            weight * loss_sum / total / self._loss_share
            for weight, loss_sum, total in zip(self.weights, loss_sums, self._totals(totals))
        ])

    def scale(self, factor):
        for window in self.windows:
            window.scale(factor)

    def reset(self):
        for window in self.windows:
            window.zero()

    def nbytes(self):
        return sum(window.nbytes() for window in self.windows)


def _add(a, b):
    """The sum of two gradients of one variable (`IndexedSlices` of the same rows add values)."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(a.values + b.values, a.indices, a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def _accumulator_dtype(variable):
    dtype = tf.as_dtype(variable.dtype)
    return tf.float64 if dtype == tf.float64 else tf.float32


def _divide(grad, denominator):
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values / tf.cast(denominator, grad.values.dtype)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return grad / tf.cast(denominator, grad.dtype)


def _cast(grad, dtype):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.cast(grad.values, dtype), grad.indices, grad.dense_shape
        )
    return tf.cast(grad, dtype)


class WindowState:
    """Everything an open window holds, and the only code that changes it.

    The accumulators (`AccumulationWindow`), the outputs that count
    differently (`OutputChannels`, made when a step first shows them), the
    counts and the window's length; its `Reduction` says what a micro-batch
    weighs and what the sum is divided by. It adds a `MicroBatch`, leaves one
    out, says whether it is full, reads its counts, gives the normalised
    gradients and the window's loss, and resets, for one channel or many.

    Args:
        strategy: The model's `tf.distribute` strategy.
        reduction: A `Reduction`.
        sparse_rows: Keep sparse gradients as rows (see `AccumulationWindow`).
        loss_share: What Keras multiplies each replica's loss by.
        dtype: The dense accumulators' dtype (see `AccumulationWindow`).
    """

    def __init__(self, strategy, reduction, *, sparse_rows, loss_share, dtype=None):
        self.strategy = strategy
        self.reduction = reduction
        self.accumulators = AccumulationWindow(strategy, sparse_rows=sparse_rows, dtype=dtype)
        self.counts = self.accumulators.counts
        self.channels = None
        self.loss_share = loss_share
        self._sums = isinstance(reduction, _reduction.Sum)
        self.loss_seen = False  # whether a traced step showed its loss
        self._warned_dense = False
        with tf.init_scope(), strategy.scope():
            self.steps = tf.Variable(tf.ones((), tf.int64), trainable=False,
                                     name="accumulation_steps")

    @property
    def traced(self):
        return self.accumulators.traced

    @property
    def variables(self):
        return self.accumulators.variables

    def _weighs_items(self, every_sample_counts):
        """Whether a micro-batch's weight is its `items` (known while tracing)."""
        return every_sample_counts and self.reduction.weighs_items

    def weight(self, samples, items, every_sample_counts=False):
        """A micro-batch's weight, from the reduction and this replica's open window.

        Where every micro-batch with a sample counts an item, a reduction that
        `weighs_items` weighs `items`: nothing to ask of the window.
        """
        if self._weighs_items(every_sample_counts):
            return items
        # Sliced only where the reduction asks ("samples" asks for none).
        return self.reduction.weight(samples, items, self.counts.read(WINDOW_COUNTS))

    # -- while a step traces --------------------------------------------------------

    def track(self, micro, create):
        """Records what a step applies: accumulators, and the outputs' channels.

        `create(make)` calls `make()` where variables can be made (see
        `Replication.create`).
        """
        self.accumulators.track(micro.grads, micro.variables)
        self.loss_seen = self.loss_seen or micro.loss is not None
        if not micro.outputs:
            return
        names = [output.name for output in micro.outputs]
        if self.channels is None:
            def make(strategy=None):
                if self.channels is not None:  # another replica's thread made them
                    return
                channels = OutputChannels(
                    self.strategy, names, [output.loss_weight for output in micro.outputs],
                    sparse_rows=self.accumulators.sparse_rows, loss_share=self.loss_share,
                    dtype=self.accumulators.dtype)
                if strategy is not None:  # cross-replica: dense, as the main window's
                    for window in channels.windows:
                        window.create_dense([v for v in micro.variables
                                             if self.accumulators.has_accumulator(v)])
                self.channels = channels

            create(make)
        elif self.channels.names != names:
            raise ValueError(
                f"The outputs whose losses count differently changed between "
                f"traces: {self.channels.names} then {names}.")
        self.channels.track([output.grads for output in micro.outputs], micro.variables)

    def warn_if_densified(self, micro, reason):
        """Warns once that `micro`'s sparse gradients are accumulated densely (`reason`)."""
        densified = [
            variable.name
            for grad, variable in zip(micro.grads, micro.variables)
            if isinstance(grad, tf.IndexedSlices) and not self.accumulators.uses_rows(variable)
        ]
        if self._warned_dense or not densified:
            return
        self._warned_dense = True
        warnings.warn(
            f"Sparse gradients of {densified} are accumulated densely under "
            f"{reason}: the optimizer receives a dense gradient, which "
            "optimizers that treat sparse rows one by one (Adam, Adagrad) "
            "apply differently from the large batch's rows. Pass "
            "sparse_gradients='dense' to accept this without a warning.",
            stacklevel=2,
        )

    def micro_step(self, micro):
        """What observers see of `micro`: a `MicroStep`."""
        return MicroStep(
            grads=list(micro.grads), variables=list(micro.variables), samples=micro.samples,
            items=micro.items, gradient_scale=micro.gradient_scale,
            mean_divisor=micro.samples if self._sums else None,
            weighs_items=self._weighs_items(micro.every_sample_counts))

    def add(self, micro, totals):
        """Adds `micro` to the window; returns the counts' delta.

        `totals`: whether the hook's totals (`samples`, `items`) count it now
        (one device) or when the window is reduced (several replicas).
        """
        # A window holds micro-batches that counted nothing only where one can.
        if self.reduction.counts_items and not micro.every_sample_counts:
            self._forget_uncounted(micro.items)
        weight = None if micro.weighted else micro.weight
        self.accumulators.add(micro.rest_grads, micro.variables, weight, loss=micro.rest_loss,
                              items=micro.items, samples=micro.samples)
        if micro.outputs:
            self.channels.add([output.grads for output in micro.outputs], micro.variables,
                              [output.count for output in micro.outputs],
                              [output.value for output in micro.outputs])
        extra = dict(samples=micro.samples, items=micro.items) if totals else {}
        return self.counts.delta(micro_steps=1, window_micro_batches=1,
                                 window_samples=micro.samples, window_items=micro.items, **extra)

    def leave_out(self, totals):
        """A micro-batch left out (non-finite): counted, not added; the delta."""
        extra = {"nonfinite_skips": 1} if totals else {}
        return self.counts.delta(micro_steps=1, window_micro_batches=1, window_nonfinite=1,
                                 **extra)

    def _forget_uncounted(self, items):
        """Empties the accumulators when the first micro-batch that counts joins a
        window of micro-batches that counted nothing (see `reduction.Auto`)."""
        counts = self.counts.read()
        uncounted = tf.logical_and(counts["window_items"] <= 0, counts["window_samples"] > 0)

        def forget():
            self.accumulators.forget_gradients()
            return tf.constant(True)

        tf.cond(tf.logical_and(uncounted, items > 0), forget, lambda: tf.constant(False))

    def position(self):
        """Micro-batches in the open window, on this machine (int64)."""
        return self.counts.local()[self.counts.names.index("window_micro_batches")]

    def is_full(self):
        return self.position() >= self.steps

    # -- when a window ends -------------------------------------------------------------

    def local(self):
        """This replica's open window: its counts and loss sums."""
        counts = self.counts.read()
        window = {name: counts[name] for name in WINDOW_COUNTS}
        window["loss_sum"] = self.accumulators.loss_sum.read_value()
        return window

    def reduced(self):
        """The open window over all replicas (cross-replica; `local()` on one)."""
        counts = self.counts.global_read()
        window = {name: counts[name] for name in WINDOW_COUNTS}
        window["loss_sum"] = self.accumulators.loss_sum.read_value()
        if self.channels is not None:
            window.update(self.channels.global_read())
        return window

    def gradients(self, denominator, channel_totals=None):
        """The window's gradients divided by `denominator`, plus each output's.

        `denominator` comes from `Replication.denominator`; `channel_totals`
        are the outputs' counts over the window (this replica's by default).
        """
        grads = self.accumulators.gradients(denominator)
        if self.channels is not None:
            grads = self.channels.combine(grads, channel_totals)
        return grads

    def loss(self, window):
        """The window's loss, weighted as the large batch's (float64)."""
        counted = window["window_items"] > 0
        loss_sum = tf.where(counted, window["loss_sum"][0], window["loss_sum"][1])
        denominator = tf.maximum(tf.cast(_reduction.counted_or_samples(window), tf.float64), 1.0)
        loss = loss_sum / denominator / self.loss_share
        if self.channels is not None:
            loss += self.channels.loss(window.get("channel_items"), window.get("channel_loss_sums"))
        return loss

    def mean_divisor(self, window):
        """What the applied gradient is divided by to be a mean over samples (`sum`)."""
        return window["window_samples"] if self._sums else None

    def reset(self, local, **extra_counts):
        """Empties the window: accumulators, channels and this replica's window counts.

        `local` is this replica's window (`local()`); `extra_counts` are added
        to the totals.
        """
        self.accumulators.reset()
        if self.channels is not None:
            self.channels.reset()
        counts = self.counts
        counts.add(counts.delta(**{name: -local[name] for name in WINDOW_COUNTS})
                   + counts.delta(**extra_counts))

    def scale(self, factor):
        """Multiplies what the window holds by `factor` (a loss scale change)."""
        self.accumulators.scale(factor)
        if self.channels is not None:
            self.channels.scale(factor)

    def zero(self):
        """Empties everything and zeroes every count (a hook installed again)."""
        self.accumulators.zero()
        if self.channels is not None:
            self.channels.reset()
