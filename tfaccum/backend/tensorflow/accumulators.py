"""The accumulators of an open window: one per variable that receives a gradient.

A dense accumulator sums into a tensor of the variable's shape (float32, or
bfloat16 summed as `precision.BFloat16Sum` does); a row accumulator keeps a
sparse gradient's rows, so the optimizer receives the window's rows as the
large batch's `IndexedSlices`. `Accumulators` holds them, the window's loss
sums and the hook's counts.
"""

import numpy as np
import tensorflow as tf

from tfaccum.backend.tensorflow import gradients
from tfaccum.backend.tensorflow import precision
from tfaccum.backend.tensorflow.counter_variable import CounterVariable
from tfaccum.backend.tensorflow.devices import assign_local
from tfaccum.backend.tensorflow.devices import local_values
from tfaccum.backend.tensorflow.devices import variable_options


class DenseAccumulator:
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
        # variable for it would keep a copy of it alive at the window's end,
        # beside the optimizer's temporaries, which is the step's peak
        # (benchmarks/memory.py measures it).
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


class BFloat16Accumulator(DenseAccumulator):
    """A dense accumulator in bfloat16, summed as `precision.BFloat16Sum` does."""

    def __init__(self, variable, synchronization, aggregation, dtype=tf.bfloat16, seeds=None):
        super().__init__(variable, synchronization, aggregation, dtype=dtype)
        self._sum = precision.BFloat16Sum(self.variable, seeds)

    def add(self, grad, weight):
        self._sum.add(grad, weight)

    def read(self):
        return self._sum.read()

    def scale(self, factor):
        self._sum.scale(factor)

    def reset(self):
        self._sum.zero()


class RowAccumulator:
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


class Accumulators:
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
        rounding: The `precision.RoundingSeeds` bfloat16 accumulators draw
            from (another window's, whose counts number the micro-steps);
            by default, under `dtype=tf.bfloat16`, made here.
    """

    def __init__(self, strategy, *, sparse_rows=True, dtype=None, rounding=None):
        self.strategy = strategy
        self.sparse_rows = sparse_rows
        self.dtype = None if dtype is None else tf.as_dtype(dtype)
        self.counts = CounterVariable(strategy)
        # Made here, its seed is this window's to renew (an output's channel
        # shares the main window's, and is emptied at each window's end).
        self._owns_rounding = rounding is None and self.dtype == tf.bfloat16
        if self._owns_rounding:
            rounding = precision.RoundingSeeds(
                strategy, lambda: self.counts.read(["micro_steps"])["micro_steps"])
        self.rounding = rounding
        self._accumulators = {}  # id(variable) -> accumulator
        # Made ahead of the first trace (`create_dense(provisional=True)`),
        # kept once a traced step shows each gets a dense gradient.
        self._provisional = set()
        self._provisional_rows = {}  # id(variable) -> RowAccumulator, made ahead
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
        self._variable_options = variable_options(strategy)

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
                return RowAccumulator(variable, *self._variable_options)
            if self.dtype == tf.bfloat16:
                return BFloat16Accumulator(variable, *self._variable_options, dtype=self.dtype,
                                           seeds=self.rounding.stream())
            return DenseAccumulator(variable, *self._variable_options, dtype=self.dtype)

    def has_accumulator(self, variable):
        return id(variable) in self._accumulators

    def uses_rows(self, variable):
        return isinstance(self._accumulators.get(id(variable)), RowAccumulator)

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
                grad = gradients.divide(grad, denominator)
            grads.append(gradients.cast(grad, variable.dtype))
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
        if self._owns_rounding:  # the micro-steps count from 0 again
            self.rounding.renew()

    # -- backups (on the host, between micro-steps) --------------------------------------

    def backup_refusal(self, held):
        """What of the window a backup cannot hold (a phrase), or `None`.

        Args:
            held: The ids of the variables whose accumulators a backup names.
        """
        if self._provisional_rows or any(
                isinstance(a, RowAccumulator) for a in self._accumulators.values()):
            return "sparse_gradients='rows' (the window's rows)"
        if set(self._accumulators) - set(held):
            return "gradients of variables outside the model's trainable_variables"
        return None

    def held(self, names):
        """What each of this machine's replicas holds, as `[{name: array}]`.

        Args:
            names: `{id(variable): name}` of the variables whose dense
                accumulators are held (`backup_refusal()` says whether that
                is all of the window).

        Returns:
            Per replica: its loss sums (`"loss_sum"`) and each accumulator
            under its variable's name (bfloat16 as float32).
        """
        held = [{"loss_sum": value} for value in local_values(self.strategy, self.loss_sum)]
        for key, accumulator in self._accumulators.items():
            if key in names and isinstance(accumulator, DenseAccumulator):
                for replica, value in zip(held, local_values(self.strategy, accumulator.variable)):
                    replica[names[key]] = value
        return held

    def hold(self, variables, held):
        """Sets what each replica holds from `held()`'s form.

        An accumulator `held` does not name is emptied; one it names that
        was not made yet (a step of the model's own, not traced) is made
        now, provisionally as `create_ahead` makes them.

        Args:
            variables: `{name: variable}` of the names `held` may use.
            held: Per replica, `{name: array}` (a loss sum missing is zero).
        """
        named = {name for replica in held for name in replica}
        # In the model's order: bfloat16 accumulators draw from streams
        # numbered as they are made.
        self.create_dense([variable for name, variable in variables.items() if name in named],
                          provisional=True)
        names = {id(variable): name for name, variable in variables.items()}
        assign_local(self.strategy, self.loss_sum,
                     [replica.get("loss_sum", np.zeros(2)) for replica in held])
        for key, accumulator in self._accumulators.items():
            if not isinstance(accumulator, DenseAccumulator):
                accumulator.reset()  # rows: on one device, a plain variable
                continue
            variable = accumulator.variable
            assign_local(self.strategy, variable, [
                replica.get(names.get(key), np.zeros(variable.shape)) for replica in held])


def _accumulator_dtype(variable):
    dtype = tf.as_dtype(variable.dtype)
    return tf.float64 if dtype == tf.float64 else tf.float32
