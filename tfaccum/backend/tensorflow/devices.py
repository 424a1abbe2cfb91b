"""One device or several replicas, chosen once when a hook is made.

Everything that differs between the two lives here: where variables are made
while a step traces, which replica feeds the observers, where a window ends
(`tf.cond` in the step, or `merge_call` to the cross-replica context), how its
counts are reduced, when the totals are counted, and when a dynamic loss
scale is lowered after a non-finite micro-batch. The window state and the
hook hold no replica branch.
"""

import tensorflow as tf

from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow.observer_states import observed_update
from tfaccum.counts import Window
from tfaccum.observing import tell


def variable_options(strategy):
    """`(synchronization, aggregation)` for an accumulator under `strategy`.

    Replicas (one or several, under a strategy) keep one each, summed when
    read across them; without a strategy a plain variable.
    """
    if _keras_on_tf.under_strategy(strategy):
        return tf.VariableSynchronization.ON_READ, tf.VariableAggregation.SUM
    return tf.VariableSynchronization.AUTO, tf.VariableAggregation.NONE


def local_values(strategy, variable):
    """Each of this machine's replicas' value of `variable`, as NumPy arrays.

    One per replica for a variable kept per replica (an accumulator, the
    counts), one for a plain or mirrored one. bfloat16 is read as float32
    (exact), which NumPy holds without ml_dtypes.
    """
    values = []
    for component in strategy.experimental_local_results(variable):
        value = component.read_value()
        if value.dtype == tf.bfloat16:
            value = tf.cast(value, tf.float32)
        values.append(value.numpy())
    return values


def assign_local(strategy, variable, values):
    """Sets each of this machine's replicas' `variable` to its entry of `values`.

    Each replica's own component is assigned: a variable summed when read
    across replicas (`ON_READ`) takes no assignment of the whole outside a
    replica context.
    """
    for component, value in zip(strategy.experimental_local_results(variable), values):
        component.assign(tf.cast(value, component.dtype))


def for_model(model, state, applier, observers, *, skip_nonfinite, source):
    """`OneDevice` without a strategy, `SeveralDevices` under one (even of one replica)."""
    cls = SeveralDevices if _keras_on_tf.under_strategy(model.distribute_strategy) else OneDevice
    return cls(model, state, applier, observers, skip_nonfinite=skip_nonfinite, source=source)


class OneDevice:
    """One replica: the window ends inside the step, with a `tf.cond`.

    Args:
        model: The compiled model.
        state: Its `WindowState`.
        applier: `applier(grads, variables, reduced)` applies gradients through
            the optimizer's own method.
        observers: The hook's `WindowObserver`s.
        skip_nonfinite: Whether non-finite micro-batches are left out.
        source: Where the window's gradients come from (`tfaccum.backend.tensorflow.sources`).
    """

    replicas = 1
    # Whether the hook's totals (samples, items, left-out micro-batches) are
    # counted as a micro-batch is added; else from the reduced window.
    totals_per_micro_batch = True
    # Whether a flush or a drop may run eagerly (op by op, untraced).
    ends_eagerly = True

    def __init__(self, model, state, applier, observers, *, skip_nonfinite, source):
        self.model = model
        self.source = source
        self.strategy = model.distribute_strategy
        self.state = state
        self.applier = applier
        self.observers = observers
        self.skip_nonfinite = skip_nonfinite
        self._optimizer = model.optimizer
        self._api = _keras_on_tf.api_for(model)

    @property
    def traced(self):
        """Whether a step has traced (before, no window can be pending)."""
        return self.source.traced

    def zero(self):
        """Forgets any open window (the hook is installed again; counts zeroed)."""
        with self.strategy.scope():
            self.source.reset()

    # -- while a step traces ----------------------------------------------------------

    def prepare(self):
        """At installation: nothing to make ahead on one device."""

    def check(self, micro):
        """Raises if `micro` cannot be accumulated here (never on one device)."""

    def create(self, make):
        """Makes variables while a step traces."""
        make()

    def observers_here(self):
        """The observers this replica feeds."""
        return self.observers

    def leave_out(self):
        """A micro-batch was left out: lower a dynamic loss scale now, as Keras does."""
        self._lower_loss_scale(rescale=True)

    def after_micro_step(self):
        """Ends the window if it is full (inside the step)."""
        applied = tf.cond(self.state.is_full(), lambda: self.end_window(self.window_counts()),
                          lambda: tf.constant(False))
        _keras_on_tf.keep_as_function_call(applied)

    # -- ending a window --------------------------------------------------------------

    def window_counts(self):
        """The open window's counts, as its end reads them (this device's)."""
        return self.state.local()

    def end_window(self, window, **extra_counts):
        """Applies `window` if any micro-batch in it counts, then resets it."""
        if not self.skip_nonfinite:
            # Nothing is left out: a window that ends holds a micro-batch
            # (full, or flushed as pending), so no branch to trace for none.
            return self._apply(window, **extra_counts)
        contributing = window["window_micro_batches"] - window["window_nonfinite"]
        return tf.cond(contributing > 0,
                       lambda: self._apply(window, **extra_counts),
                       lambda: self._skip(window))

    def _apply(self, window, **extra_counts):
        return self.apply_window(window, self.source.prepare(window), **extra_counts)

    def _skip(self, window):
        self._api.count_nonfinite_window(self._optimizer)
        self._reset(window, window)
        return tf.constant(False)

    def apply_window(self, window, prepared, **extra_counts):
        """Applies the source's gradients through the optimizer, tells the observers, resets.

        The one window end of every model. With several replicas this runs on
        each, `window` holding the counts of all of them (`local`: this
        replica's); `prepared` is what the source prepared once for the window.
        """
        local = self.state.local()
        counts = self._totals_before(window)
        denominator = self.denominator(window, local) if self.source.divides else None
        grads = self._reduce(self.source.gradients(prepared, window, denominator))
        variables = self.state.variables
        gradient_scale = self._api.loss_scale(self._optimizer)  # before the update
        iterations = _keras_on_tf.iterations(self._optimizer)
        before = tf.convert_to_tensor(iterations) if self.source.may_skip else None
        self.applier(grads, variables, self.replicas > 1)
        applied = 1
        if before is not None:  # a LossScaleOptimizer skips a non-finite window
            applied = tf.cast(tf.convert_to_tensor(iterations) > before, tf.int64)
        tell(self.observers_here(), "on_apply", observed_update(
            grads, variables, gradient_scale, self.state.mean_divisor(window), window=window,
            counts=counts, iterations=iterations, loss=self.source.loss(prepared, window)))
        self._reset(local, window, optimizer_steps=applied, **extra_counts)
        return tf.constant(True)

    def denominator(self, window, local):
        """What the window's summed gradient is divided by (`None`: nothing)."""
        return self.state.reduction.denominator(window)

    def _totals_before(self, window):
        """The totals the observers see with the update (this replica's, before it)."""
        return dict(self.state.counts.read())

    def _reduce(self, grads):
        """The gradients the optimizer receives."""
        return grads

    def _reset(self, local, window, **extra_counts):
        self.state.reset(local, **extra_counts)
        tell(self.observers_here(), "on_reset")
        self.source.reset()

    def _lower_loss_scale(self, rescale):
        """Lowers a dynamic loss scale after a non-finite micro-batch, as Keras does."""
        if not _keras_on_tf.scales_loss_dynamically(self._optimizer):
            return tf.constant(False)
        factor = self._api.lower_loss_scale(self._optimizer)
        if rescale and factor is not None:
            # What the window holds was scaled by the old scale: rescale it.
            self.state.scale(factor)
        return tf.constant(True)

    # -- host-triggered window ends (traced in their own functions) ---------------------

    def flush_graph(self):
        """Ends the open window (run only when `pending` found micro-batches in it)."""
        window = self.window_counts()
        self.end_window(window, flushes=1)
        return window["window_micro_batches"], window["window_samples"]

    def drop_graph(self):
        window = self.window_counts()
        _keras_on_tf.for_each_replica(self.strategy, self._drop_on_replica, args=(window,))
        return window["window_micro_batches"], window["window_samples"]

    def _drop_on_replica(self, window):
        local = self.state.local()
        self._reset(local, window, dropped_micro_steps=local["window_micro_batches"])

    def pending(self, run):
        """The open window as a `Window` (`run(name, graph)` runs a graph): a host read."""
        counts = self.state.counts.numpy()
        return Window(counts["window_micro_batches"], counts["window_samples"])

    def pending_graph(self):
        window = self.window_counts()
        return window["window_micro_batches"], window["window_samples"]


class SeveralDevices(OneDevice):
    """Several replicas (one machine or several): the window ends in the cross-replica context.

    Keras' optimizer calls `merge_call`, which a `tf.cond` in a replica
    context cannot hold (keras-team/keras#20582): a full window is decided in
    the cross-replica context, as `LossScaleOptimizer` does. Accumulators are
    made when the hook is installed (variables cannot be made in a replica's
    step); observers are fed by each machine's first replica; the totals are
    counted from the reduced window; a replica that left out its share keeps
    the loss scale until the window's end, where it is lowered once, alike
    on every replica.
    """

    totals_per_micro_batch = False
    ends_eagerly = False  # merge_call and collectives: always in a function

    def __init__(self, model, state, applier, observers, *, skip_nonfinite, source):
        super().__init__(model, state, applier, observers, skip_nonfinite=skip_nonfinite,
                         source=source)
        self.replicas = self.strategy.num_replicas_in_sync
        reduction = state.reduction
        if skip_nonfinite and reduction.per_micro_batch and self.replicas > 1:
            raise ValueError(
                "skip_nonfinite (and mixed precision) with several replicas "
                "leaves out one replica's share of a micro-batch, which "
                f"reduction={reduction!r} (every micro-batch weighs the same) cannot "
                "weigh. Received: reduction="
                f"{reduction!r} with skip_nonfinite={skip_nonfinite} under "
                f"{type(self.strategy).__name__} with {self.replicas} replicas. "
                "Use reduction='auto' or 'samples'."
            )

    def prepare(self):
        if self.model.built:
            self.state.accumulators.create_dense(self.model.trainable_variables)

    def check(self, micro):
        if tf.executing_eagerly():
            return
        for grad, variable in zip(micro.grads, micro.variables):
            if grad is not None and not self.state.accumulators.has_accumulator(variable):
                raise ValueError(
                    f"Variable {variable.name!r} received a gradient but "
                    "is not among the model's trainable variables. With "
                    "several replicas, accumulators are made when the hook "
                    "is installed, from `model.trainable_variables`."
                )

    def create(self, make):
        tf.distribute.get_replica_context().merge_call(make)

    def observers_here(self):
        """The observers this replica feeds (at trace time).

        Those that watch the window as a whole are fed by this machine's
        first replica only: its micro-batches, and the window reduced over
        every replica. Nothing crosses devices for them.
        """
        context = tf.distribute.get_replica_context()
        if context is None:  # cross-replica (a flush, a drop): every observer
            return self.observers
        replica = tf.get_static_value(context.replica_id_in_sync_group)
        if replica is None and not all(o.per_replica for o in self.observers):
            raise ValueError(
                f"{type(self.strategy).__name__} does not say which replica a "
                "step runs on while it traces; the summaries (log_dir) and the "
                "noise scale need it. Received: observers "
                f"{[type(o).__name__ for o in self.observers]}. Turn them off "
                "(log_dir=None, noise_scale=False) under this strategy."
            )
        local_replicas = len(self.strategy.extended.worker_devices)
        first = replica is not None and replica % local_replicas == 0
        return [o for o in self.observers if first or o.per_replica]

    def leave_out(self):
        """The loss scale is lowered at the window's end, alike on every replica."""

    def window_counts(self):
        """The open window's counts summed over replicas (cross-replica)."""
        return self.state.reduced()

    def pending(self, run):
        """The open window summed over replicas: every worker must read it."""
        if not self.traced:
            return super().pending(run)
        return run("pending", self.pending_graph)

    def denominator(self, window, local):
        """The reduction's denominator, with Keras' per-replica loss share undone.

        Keras divides each replica's loss by the number of replicas (the loss
        share) and the replicas' gradients are summed.
        """
        denominator = self.state.reduction.denominator(window)
        if denominator is None:
            return None
        share = self.state.loss_share
        if self.state.reduction.per_micro_batch:
            if share * self.replicas == 1.0:
                return denominator
            share *= self.replicas  # the replicas' mean losses sum to replicas times one
        denominator = tf.cast(denominator, tf.float64) * share
        kept = self.state.reduction.keeps(local, window)
        if kept is not True:
            denominator = tf.where(kept, denominator, float("inf"))
        return denominator

    def _totals_before(self, window):
        # What the reduced window adds to this replica's totals.
        counts = self.state.counts.read()
        return dict(counts, nonfinite_skips=counts["nonfinite_skips"] + window["window_nonfinite"])

    def _reduce(self, grads):
        # Applied as on one device: the optimizer receives (and clips) the
        # window's gradient summed over replicas.
        return _keras_on_tf.all_reduce_sum(grads)

    def _reset(self, local, window, **extra_counts):
        # The reduced window's samples, items and left-out shares join the totals.
        extra_counts.update(samples=window["window_samples"], items=window["window_items"],
                            nonfinite_skips=window["window_nonfinite"])
        super()._reset(local, window, **extra_counts)

    def after_micro_step(self):
        # Every replica, on every worker, holds the same position in the
        # window: read this worker's own; counts are reduced only when the
        # window is applied.
        def decide(strategy):
            return tf.cond(self.state.is_full(),
                           lambda: self.end_window(self.window_counts()),
                           lambda: tf.constant(False))

        tf.distribute.get_replica_context().merge_call(decide)

    def end_window(self, window, **extra_counts):
        """Ends the window on every replica, from its reduced counts (cross-replica).

        A replica that left its share of a micro-batch out (non-finite) kept
        the loss scale: the window's gradients were all scaled alike. It is
        lowered once here, after the update, if any share was left out.
        """
        applied = tf.cond(
            window["window_samples"] > 0,
            lambda: self._apply_on_replicas(window, **extra_counts),
            lambda: self._skip_on_replicas(window),
        )
        if self.skip_nonfinite and _keras_on_tf.scales_loss_dynamically(self._optimizer):
            lowered = tf.cond(window["window_nonfinite"] > 0,
                              lambda: self._lower_loss_scale(rescale=False),
                              lambda: tf.constant(False))
            with tf.control_dependencies([applied, lowered]):
                applied = tf.identity(applied)
        return applied

    def _apply_on_replicas(self, window, **extra_counts):
        prepared = self.source.prepare(window)  # once per window, cross-replica
        with self._api.own_reduction_off(self._optimizer):
            _keras_on_tf.for_each_replica(self.strategy, self.apply_window, args=(window, prepared),
                                          kwargs=extra_counts)
        return tf.constant(True)

    def _skip_on_replicas(self, window):
        """Every share of every micro-batch was left out: no update."""
        self._api.count_nonfinite_window(self._optimizer)
        _keras_on_tf.for_each_replica(self.strategy, self._skip_on_replica, args=(window,))
        return tf.constant(False)

    def _skip_on_replica(self, window):
        self._reset(self.state.local(), window)
