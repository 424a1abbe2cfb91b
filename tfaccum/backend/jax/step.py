"""The accumulating step on JAX: compiled functions the host calls in turn.

Keras' JAX trainer calls `model.train_function(state, iterator)` from the
host, batch by batch. The host knows where a window ends (it counts the
micro-batches): every micro-batch runs `accumulate` (forward, backward, the
gradient added into the accumulators), and a window's end then runs
`normalize` (the sum divided, in place; the observers see the update) and
`apply` (the optimizer's update, reading the accumulators; the next window's
first micro-batch overwrites them). Nothing computes an update only to throw
it away, nothing keeps a copy of the variables to choose between, and no
function holds a second copy of the window: the state and the accumulators
are donated, so XLA updates them in place (`benchmarks/jax_backend.py`).
`flush` runs the last two from the host.

Each function is written for one device's share of a micro-batch
(`devices.py`): on one device the share is all of it; under
`keras.distribution.DataParallel` every device adds its share's gradient to
its own accumulators, and a window's end reduces them once.

The reduction says what each micro-batch weighs and what the window divides
by, on the open window's counts (`keras.ops` on JAX arrays).
"""

import jax
import jax.numpy as jnp
import keras

from tfaccum._keras import counted_losses
from tfaccum import items as said_items
from tfaccum import reduction as reductions
from tfaccum.backend.jax import _keras_on_jax
from tfaccum.backend.jax.devices import BATCH
from tfaccum.backend.jax.devices import OneDevice
from tfaccum.backend.jax.devices import SHARED
from tfaccum.backend.jax.devices import SPLIT
from tfaccum.backend.jax.output_channels import OutputChannels
from tfaccum.backend.jax.precision import Rounding
from tfaccum.observing import MicroStep
from tfaccum.observing import Update
from tfaccum.counts import DEVICE_WINDOW_COUNTS
from tfaccum.counts import WINDOW_COUNTS
from tfaccum.counts import device_index


# Where the window vector a step receives holds the micro-step's number, after its counts.
STEP = len(WINDOW_COUNTS)


def window_counts(vector):
    """`{count name: int32 scalar}` of a vector ordered as `WINDOW_COUNTS`."""
    return {name: vector[i] for i, name in enumerate(WINDOW_COUNTS)}


def check_count(items):
    """Checks what `count_items()` said in a step while it traces (a number, a
    scalar); returns it as float32, which the host checks as the step runs (a
    bad count as it was said, a NaN as a NaN)."""
    dtype = jnp.result_type(items)
    said_items.check_traced(
        items, dtype_name=str(dtype), is_number=jnp.issubdtype(dtype, jnp.number),
        shape=tuple(jnp.shape(items)))
    return jnp.asarray(items).astype(jnp.float32)


def all_finite(grads):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads]))


def select(condition, chosen, otherwise):
    """`chosen` where `condition` holds, else `otherwise` (trees of arrays alike)."""
    return jax.tree.map(lambda a, b: jnp.where(condition, a, b), chosen, otherwise)


def squared_norm(grads):
    # A dot product of each gradient with itself: XLA's CPU backend runs a dot
    # on every core, where a reduction inside a compiled loop runs on one.
    return sum(jnp.vdot(flat, flat) for flat in (jnp.ravel(g).astype(jnp.float32)
                                                 for g in grads))


def share_window(window, counted, shares):
    """A device's part of the window's counts (`WINDOW_COUNTS`): its share of the
    samples kept (Keras splits every micro-batch evenly over `shares`), the
    items it counted and the micro-batches left out (counted on the first)."""
    samples = window[1] // shares - counted[device_index("window_samples_left_out")]
    return (window.at[1].set(samples).at[2].set(counted[device_index("window_items")])
            .at[3].set(counted[device_index("window_nonfinite")]))


def micro_batch_loss(share, shares, channels=None):
    """The micro-batch's loss, from its `shares` shares' (Keras' logs and loss tracker);
    with outputs apart (`channels`), from their counts over every share."""
    if shares == 1:
        return share["loss"]
    if "apart" in share:
        vector = jnp.sum(jnp.reshape(share["apart"], (shares, -1)), axis=0)
        return channels.loss(vector, jnp.sum(share["samples"]))
    norm = jnp.sum(share["norm"])
    weighted = jnp.sum(share["factor"] * share["loss"].astype(jnp.float32))
    return jnp.where(norm > 0, weighted / jnp.where(norm > 0, norm, 1.0),
                     jnp.mean(share["loss"]))


class CompiledSteps:
    """The three compiled functions of one hook.

    `accumulate` and `normalize` take and return the observers' device states
    (`observed`, one per observer) beside the accumulators.

    Args:
        model: The compiled Keras model (JAX backend).
        reduction: The hook's `Reduction`.
        observers: The hook's `WindowObserver`s (`tfaccum.observing`).
        jit: Whether to compile (`False` under `run_eagerly=True` or
            `jit_compile=False`, on one device).
        devices: Where the step runs (`devices.for_distribution`).
        rounding: How the accumulators store their sums (`precision.Rounding`).
        skip_nonfinite: Whether a micro-batch whose gradient is not finite is
            left out of its window (resolved: on under a `LossScaleOptimizer`).
        staging: Where layers hand out what their forward pass saw (the
            `AccumBatchNormalization` layers' moments: `batch_norm.staging`),
            or `None`.
    """

    def __init__(self, model, reduction, observers=(), jit=True, devices=None, rounding=None,
                 skip_nonfinite=False, staging=None):
        self.model = model
        self.staging = staging
        self.reduction = reduction
        self.rounding = rounding or Rounding("float32")
        self.skips = skip_nonfinite
        # Whether a step said a tensor count (`count_items()`): the host checks it.
        self.says_counts = False
        self.observers = tuple(observers)
        self.devices = devices or OneDevice()
        self.channels = None  # the outputs accumulated apart (`new_accumulators`)
        self._looked_for_channels = not reduction.counts_items
        # Norms of the gradients of mean losses: a summed loss's are divided.
        self._sums = isinstance(reduction, reductions.Sum)
        # One device's share run outside `jit` runs op by op over the mesh
        # (minutes for a small transformer): several devices always compile.
        jit = jit or self.devices.shares > 1
        self.jit = jit
        compile_ = (lambda f, donate: jax.jit(f, donate_argnums=donate)) if jit else (
            lambda f, donate: f)
        each_share = self.devices.each_share
        self._add_share = each_share(
            self._share, (SHARED, SPLIT, SPLIT, BATCH, SHARED, SHARED),
            (SPLIT, SPLIT, SPLIT, BATCH, SPLIT, SHARED))
        self.accumulate = compile_(self._accumulate, (0, 1, 2, 3))
        self.normalize = compile_(each_share(
            self._normalize, (SPLIT, SHARED, SPLIT, SHARED),
            (SPLIT, SHARED, SPLIT, SHARED, SHARED)), (0, 1, 2))
        self.apply = compile_(each_share(
            self._apply, (SHARED, SHARED, SPLIT, SHARED), (SHARED, SHARED)), (0, 1))

    def new_accumulators(self, state, data=None):
        """The window's accumulators for `state`'s trainable variables, one set per
        device, in the rounding's dtype, then those of the outputs accumulated
        apart, looked for once, in the first micro-batch (`data`)."""
        if not self._looked_for_channels and data is not None:
            self._looked_for_channels = True
            self.channels = OutputChannels.find(self.model, state, data)
        made = [self.devices.zeros(v.shape, self.rounding.dtype) for v in state[0]]
        return made + (self.channels.new(state[0], self.devices, self.rounding.dtype)
                       if self.channels is not None else [])

    @property
    def loss_scale(self):
        """Where a dynamic loss scale's variables are in the optimizer's (a micro-batch
        left out lowers it, as Keras lowers it after a step), or `None`. Read as
        the step traces: a hook may be installed before `fit` builds them."""
        return _keras_on_jax.loss_scale_positions(self.model.optimizer) if self.skips else None

    # -- inside the compiled functions ----------------------------------------------

    def _accumulate(self, state, accumulators, observed, counted, data, open_window, samples):
        """Adds one micro-batch (or leaves it out: `skip_nonfinite`).

        Args:
            counted: The counts the device keeps (`DEVICE_COUNTS`; one vector
                per device under `DataParallel`).
            open_window: The window's host counts before it (`WINDOW_COUNTS`),
                then the micro-step's number (`STEP`).
            samples: Its samples.
        """
        model = self.model
        trainable, _, optimizer_variables, _ = state
        accumulators, counted, share, y_pred, changed, metrics = self._add_share(
            state, accumulators, counted, data, open_window, samples)
        non_trainable = list(state[1])
        for i, value in zip(self._changed, changed):
            non_trainable[i] = self.devices.first(value)
        finite = jnp.reshape(share["finite"], (-1,))[0] > 0  # alike on every device
        loss_scale = self.loss_scale
        if loss_scale is not None:
            scale, counter = loss_scale
            optimizer_variables = list(optimizer_variables)
            optimizer_variables[scale] = jnp.where(
                finite, optimizer_variables[scale], optimizer_variables[scale] * 0.5)
            optimizer_variables[counter] = jnp.where(
                finite, optimizer_variables[counter], jnp.zeros_like(optimizer_variables[counter]))
        if self.observers:
            # Each device's share is a micro-batch to the observers.
            squares, means, added, losses, sample_counts = (
                jnp.reshape(share[name], (-1,))
                for name in ("square", "mean_square", "added", "loss", "samples"))
            for i in range(self.devices.shares):
                step = MicroStep(squared_norm=squares[i], mean_squared_norm=means[i],
                                 items=added[i], measured_items=added[i],
                                 samples=sample_counts[i],
                                 loss=losses[i].astype(jnp.float32), measured=True,
                                 moments=share["moments"])
                added_state = tuple(dict(s, **o.on_micro_step(s, step))
                                    for o, s in zip(self.observers, observed))
                if self.skips:
                    left_out = tuple(dict(s, **o.on_leave_out(s, step))
                                     for o, s in zip(self.observers, observed))
                    added_state = select(finite, added_state, left_out)
                observed = added_state
        loss = micro_batch_loss(share, self.devices.shares, self.channels)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        logs, metrics = _keras_on_jax.update_metrics(model, metrics, loss, (x, y, sample_weight),
                                                     y_pred)
        state = (trainable, non_trainable, optimizer_variables, metrics)
        return logs, state, accumulators, observed, counted, jnp.reshape(share["count"], (-1,))

    def _share(self, state, accumulators, counted, data, open_window, samples):
        """One device's share of a micro-batch: its gradient added, as its reduction weighs it.

        Returns its accumulators and counts, its scalars (`share`: the loss and
        what weighs it, the gradient's squared norm, what it counted, whether
        the micro-batch was kept), its
        predictions, the non-trainable variables its forward pass changed (at
        the positions it keeps in `self._changed` while it traces) and the
        metrics.
        """
        model, devices = self.model, self.devices
        trainable, non_trainable, optimizer_variables, metrics = state
        if devices.shares > 1:
            non_trainable = _keras_on_jax.offset_seeds(model, non_trainable, devices.index())
        given = list(non_trainable)
        channels = self.channels
        with counted_losses.loss_inputs(model) as seen, said_items.collected() as said:
            apart = None if channels is None else channels.apart(
                seen, model.optimizer, optimizer_variables)
            grads, loss, y_pred, non_trainable, new_metrics, _, moments, outputs = (
                _keras_on_jax.gradient_and_outputs(
                    model, (trainable, non_trainable, optimizer_variables, metrics), data,
                    staging=self.staging, apart=apart))
        said_items.check_said_once(said)
        samples = samples // devices.shares
        # What the loss averaged over: what `count_items()` said, or its
        # unmasked elements where a mask or `ignore_class` reached it (one
        # output), else the samples.
        averaged_over = ((said[0] if said else seen["items"]) if self.reduction.counts_items
                         else None)
        count = jnp.float32(0)
        if said and said_items.is_tensor(said[0]):
            count = check_count(said[0])
            self.says_counts = True
        added = samples if averaged_over is None else jnp.asarray(averaged_over).astype(jnp.int32)
        open_window = share_window(open_window, counted, devices.shares)
        square = mean_square = jnp.zeros((), jnp.float32)
        if self.observers:
            square = mean_square = squared_norm(
                channels.full_gradient(grads, outputs) if outputs else grads)
            if self._sums:
                mean_square = square / jnp.square(jnp.maximum(samples, 1).astype(jnp.float32))
        weight = self.reduction.weight(samples, added, window_counts(open_window))
        factor = weight
        if weight is None and self.reduction.per_micro_batch and devices.shares > 1:
            factor = 1.0 / devices.shares  # the shares' mean is the micro-batch's
        if factor is not None:
            grads = [g * jnp.asarray(factor, g.dtype) for g in grads]
        finite = jnp.bool_(True)
        if self.skips:
            # Left out whole where any device's share is not finite: every
            # device keeps or leaves the same micro-batches.
            here = jnp.logical_not(all_finite(
                grads + [g for shares, _, _ in outputs for g in shares])).astype(jnp.int32)
            finite = devices.total(here) == 0
            added = jnp.where(finite, added, 0)
        # A window's first micro-batch overwrites what the last window left;
        # so does the first that counts items after micro-batches that
        # counted none (their weight was a stand-in: `reduction.Auto`).
        restart = open_window[0] == 0
        if self.reduction.counts_items:
            restart = restart | ((open_window[2] <= 0) & (added > 0))
        held = [jnp.where(restart, 0.0, a.astype(jnp.float32)) for a in accumulators]
        summed = [h + g.astype(jnp.float32) for h, g in zip(held, grads)]
        if outputs:
            summed += channels.add(held[len(grads):], outputs, samples, loss)
        sums = len(summed) - bool(outputs)  # the outputs' counts: not scaled, not rounded
        if self.skips:
            # What the window holds was scaled by the loss scale, which a
            # micro-batch left out halves.
            lowered = 0.5 if self.loss_scale is not None else 1.0
            summed = [jnp.where(finite, s, h * lowered if i < sums else h)
                      for i, (s, h) in enumerate(zip(summed, held))]
            left = jnp.logical_not(finite)
            once = (left & (devices.index() == 0)).astype(jnp.int32)
            samples_left = jnp.where(left, samples, 0).astype(jnp.int32)
            for name, value in (("window_nonfinite", once), ("nonfinite_skips", once),
                                ("window_samples_left_out", samples_left),
                                ("samples_left_out", samples_left)):
                counted = counted.at[device_index(name)].add(value)
        accumulators = self.rounding.store(summed[:sums], open_window[STEP],
                                           devices.index()) + summed[sums:]
        factor = jnp.asarray(1.0 if factor is None else factor, jnp.float32)
        share = {"loss": loss, "factor": factor, "square": square, "mean_square": mean_square,
                 "added": added, "finite": finite.astype(jnp.int32),
                 "count": count,
                 "samples": jnp.asarray(samples, jnp.int32),
                 # Its `AccumBatchNormalization` layers' moments (one device).
                 "moments": moments,
                 # What the micro-batch's loss divides the shares' weighted sum by.
                 "norm": factor if weight is not None else jnp.float32(1.0 / devices.shares)}
        if outputs:  # what the micro-batch's loss is made of, across its shares
            share["apart"] = channels.counted(outputs, samples, loss)
        # What the forward pass changed (a seed, a statistic); a frozen
        # layer's weights come back as they went in, and stay where they are.
        self._changed = [i for i, (new, old) in enumerate(zip(non_trainable, given))
                         if new is not old]
        changed = [non_trainable[i] for i in self._changed]
        if devices.shares > 1:
            new_metrics = [m + devices.total(n - m) for m, n in zip(metrics, new_metrics)]
            changed = [devices.total(v) / devices.shares
                       if jnp.issubdtype(v.dtype, jnp.floating) else v for v in changed]
        for name in ("window_items", "items"):
            counted = counted.at[device_index(name)].add(added)
        return accumulators, counted, share, y_pred, changed, new_metrics

    def _normalize(self, accumulators, observed, counted, window):
        """The window's sum divided as the reduction says, in place; the observers
        see the update it will make.

        Returns the accumulators, the observers' states, the device's counts
        with the window's emptied, the window's counts over every device
        (`WINDOW_COUNTS`) and whether it holds a micro-batch that was kept (if
        not, `apply` makes no update).
        """
        total = self.devices.total
        local = share_window(window, counted, self.devices.shares)
        window = window.at[1].set(total(local[1])).at[2].set(total(local[2])).at[3].set(
            total(local[3]))
        counts = window_counts(window)
        contributing = (counts["window_micro_batches"] - counts["window_nonfinite"]) > 0
        main = len(self.model.trainable_variables)
        accumulators, apart = accumulators[:main], accumulators[main:]
        if self.devices.shares > 1:
            # A device whose shares counted nothing in a window that did adds
            # nothing (what it added weighed its samples: `reduction.Auto`; the
            # outputs apart add what they counted).
            kept = self.reduction.keeps(window_counts(local), counts)
            if kept is not True:
                accumulators = [jnp.where(kept, a, 0.0) for a in accumulators]
        # The devices' sums: once a window.
        accumulators = [total(a.astype(jnp.float32)) for a in accumulators]
        denominator = self.reduction.denominator(counts)
        if denominator is not None:
            accumulators = [a / jnp.asarray(denominator, a.dtype) for a in accumulators]
        window_loss = None  # the host's (`after_apply`), but where outputs are apart
        if apart:
            accumulators = self.channels.combine(accumulators, apart, total)
            window_loss = self.channels.window_loss(apart, total, counts["window_samples"])
        # Every device rounds alike: each applies the same update.
        accumulators = self.rounding.store(accumulators, window[STEP])
        if self.observers:
            before = observed
            squares = [squared_norm([a]) for a in accumulators]
            square = mean_square = sum(squares)
            if self._sums:
                samples = jnp.maximum(counts["window_samples"], 1).astype(jnp.float32)
                mean_square = square / jnp.square(samples)
            # The window's counts and loss are the host's (`after_apply`).
            update = Update(squared_norm=square, mean_squared_norm=mean_square,
                            variables=self.model.trainable_variables, variable_squares=squares,
                            gradient_scale=None, window=counts, counts=None, iterations=None,
                            loss=window_loss)
            observed = tuple(dict(s, **o.on_apply(s, update))
                             for o, s in zip(self.observers, observed))
            if self.skips:
                observed = select(contributing, observed, before)
            observed = tuple(dict(s, **o.on_reset(s)) for o, s in zip(self.observers, observed))
        for name in DEVICE_WINDOW_COUNTS:
            counted = counted.at[device_index(name)].set(0)
        if self.skips:
            empty = (jnp.logical_not(contributing) & (self.devices.index() == 0))
            counted = counted.at[device_index("windows_left_out")].add(empty.astype(jnp.int32))
        return accumulators + apart, observed, counted, window[:STEP], contributing

    def _apply(self, trainable, optimizer_variables, accumulators, contributing):
        """The normalised window applied once (not at all where every micro-batch
        was left out). The accumulators are only read: the window's first
        micro-batch overwrites them (`_accumulate`)."""
        grads = [a.astype(v.dtype) for a, v in zip(accumulators, trainable)]
        apply = self.model.optimizer.stateless_apply
        if not self.skips:
            return apply(optimizer_variables, grads, trainable)
        return jax.lax.cond(contributing, lambda: apply(optimizer_variables, grads, trainable),
                            lambda: (list(trainable), list(optimizer_variables)))
