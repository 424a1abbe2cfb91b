"""The accumulation window: what has been added since the last update.

`WindowState` is the window a hook holds: the accumulators
(`Accumulators`: one per variable that received a gradient), one more
set per output that counts differently (`OutputChannels`), the `CounterVariable`,
the window's length and its `Reduction`; it alone adds a micro-batch, leaves
one out, says whether it is full, reads its counts, normalises and resets.
Everything here runs inside the compiled train step.
"""

import warnings

import tensorflow as tf

from tfaccum import output_weighting
from tfaccum import reduction as _reduction
from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow import gradients
from tfaccum.backend.tensorflow.accumulators import Accumulators
from tfaccum.backend.tensorflow.observer_states import observed_micro_step
from tfaccum.counts import WINDOW_COUNTS


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
        sparse_rows: As `Accumulators`'.
        loss_share: What Keras multiplies each replica's losses by (see
            `_keras_on_tf.replica_loss_share`).
        dtype, rounding: As `Accumulators`' (the main window's `rounding`).
    """

    def __init__(self, strategy, names, weights, *, sparse_rows=True, loss_share=1.0,
                 dtype=None, rounding=None):
        self.names = list(names)
        self.weights = output_weighting.loss_weights(weights)
        # bfloat16 channels draw from the main window's seeds: theirs count no micro-step.
        self.channels = [Accumulators(strategy, sparse_rows=sparse_rows, dtype=dtype,
                                      rounding=rounding)
                         for _ in names]
        self._loss_share = loss_share

    def track(self, grads_per_output, variables):
        for channel, grads in zip(self.channels, grads_per_output):
            channel.track(grads, variables)

    def add(self, grads_per_output, variables, counts, values):
        """Adds each output's gradient times its count (its loss as a sum)."""
        for channel, grads, count, value in zip(self.channels, grads_per_output, counts, values):
            channel.add(grads, variables, count, loss=value, items=count)
            channel.counts.add(channel.counts.delta(window_items=count))

    def global_read(self):
        """Each output's count and loss sum over every replica (cross-replica)."""
        return {
            "channel_items": [c.counts.global_read()["window_items"] for c in self.channels],
            "channel_loss_sums": [c.loss_sum.read_value()[0] for c in self.channels],
        }

    def _totals(self, totals):
        if totals is None:  # this replica's (all of them, on one)
            totals = [channel.counts.read()["window_items"] for channel in self.channels]
        return [tf.cast(total, tf.float64) for total in totals]

    def combine(self, grads, totals=None):
        """`grads` (the main accumulators', normalised) plus each output's, normalised.

        `totals`: each output's count over the window (`global_read()`'s), by
        default this replica's.
        """
        for channel, total in zip(self.channels, self._totals(totals)):
            divisor = output_weighting.divisor(total, self._loss_share, tf.math)
            grads = [gradients.add(a, b) for a, b in zip(grads, channel.gradients(divisor))]
        return grads

    def loss(self, totals=None, loss_sums=None):
        """The outputs' part of the window's loss: each weighted mean over its total."""
        if loss_sums is None:
            loss_sums = [channel.loss_sum.read_value()[0] for channel in self.channels]
        return output_weighting.window_loss(
            self.weights, loss_sums, self._totals(totals), self._loss_share, tf.math)

    def scale(self, factor):
        for channel in self.channels:
            channel.scale(factor)

    def reset(self):
        for channel in self.channels:
            channel.zero()

    def nbytes(self):
        return sum(channel.nbytes() for channel in self.channels)


class WindowState:
    """Everything an open window holds, and the only code that changes it.

    The accumulators (`Accumulators`), the outputs that count
    differently (`OutputChannels`, made when a step first shows them), the
    counts and the window's length; its `Reduction` says what a micro-batch
    weighs and what the sum is divided by. It adds a `MicroBatch`, leaves one
    out, says whether it is full, reads its counts, gives the normalised
    gradients and the window's loss, and resets, for one channel or many.

    Args:
        strategy: The model's `tf.distribute` strategy.
        reduction: A `Reduction`.
        sparse_rows: Keep sparse gradients as rows (see `Accumulators`).
        loss_share: What Keras multiplies each replica's loss by.
        dtype: The dense accumulators' dtype (see `Accumulators`).
    """

    def __init__(self, strategy, reduction, *, sparse_rows, loss_share, dtype=None):
        self.strategy = strategy
        self.reduction = reduction
        self.accumulators = Accumulators(strategy, sparse_rows=sparse_rows, dtype=dtype)
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

    def create_ahead(self, model, api):
        """Makes the optimizer's variables and the accumulators now, on the host.

        A `tf.function` that makes variables on its first call traces twice;
        made here, Keras' own step on a built model traces once (Keras itself
        builds the optimizer in its first trace on one device). Embedding
        tables get rows as well as a dense accumulator; the trace keeps one.
        """
        if not model.built or not _keras_on_tf.trains_with_keras_step(model):
            return
        with tf.init_scope(), model.distribute_strategy.scope():
            api.build_optimizer(model.optimizer, model.trainable_variables)
            self.accumulators.create_dense(model.trainable_variables, provisional=True)
            # Under a strategy `SeveralDevices.prepare` made them dense for good:
            # no rows there.
            self.accumulators.create_rows(_keras_on_tf.embedding_tables(model))

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
                    dtype=self.accumulators.dtype, rounding=self.accumulators.rounding)
                if strategy is not None:  # cross-replica: dense, as the main window's
                    for channel in channels.channels:
                        channel.create_dense([v for v in micro.variables
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
        """What observers see of `micro`: a `tfaccum.observing.MicroStep`."""
        return observed_micro_step(
            list(micro.grads), samples=micro.samples, items=micro.items, loss=micro.loss,
            gradient_scale=micro.gradient_scale,
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
