"""The train step of a model without a window-wide loss: its gradients, into the window.

The model's own `train_step` runs under a `StepTracer`, which hands its
gradients over as one `MicroBatch`; `AccumulatingStep` adds it to the window
state (or leaves it out, non-finite) and lets its devices (`devices.py`) end a
full window, whose source is the accumulators (`sources.AccumulatedGradients`).
`gradient_cache.CachingStep` is the other kind of step; a hook chooses one.
"""

import tensorflow as tf

from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow import gradients
from tfaccum.backend.tensorflow.devices import for_model
from tfaccum.backend.tensorflow.sources import AccumulatedGradients
from tfaccum.backend.tensorflow.step import StepTracer
from tfaccum.observing import tell


class AccumulatingStep:
    """Runs the model's own step and accumulates the gradients it applies.

    Args:
        model: The compiled model.
        state: The hook's `WindowState`.
        observers: The hook's `WindowObserver`s.
        configuration: The hook's `Configuration`.
        skip_nonfinite: Whether non-finite micro-batches are left out (resolved).
        original_train_step: Returns the model's own `train_step` (Keras' or
            an override), called at each step.
    """

    def __init__(self, model, state, observers, configuration, *, skip_nonfinite,
                 original_train_step):
        api = _keras_on_tf.api_for(model)
        self.model = model
        self.state = state
        self.configuration = configuration
        self.skip_nonfinite = skip_nonfinite
        self._original_train_step = original_train_step
        self.tracer = StepTracer(
            model, counts_items=configuration.reduction.counts_items, weigh=state.weight,
            # Weighting the loss by the micro-batch's weight weights every
            # gradient at once (cheaper than scaling each accumulated one),
            # except under dynamic loss scaling, whose scale must stay a power of 2.
            weight_in_loss=api.scales_loss_in_step
            and not _keras_on_tf.scales_loss_dynamically(model.optimizer),
            loss_share=state.loss_share, on_micro_batch=self._micro_step)
        self.devices = for_model(
            model, state, self.tracer.apply_gradients, observers,
            skip_nonfinite=skip_nonfinite, source=AccumulatedGradients(state))

    def train_step(self, data):
        """The model's own step, its gradients handed to the window."""
        logs, nothing = self.tracer.train_step(self._original_train_step(), data)
        if nothing:  # nothing to train: Keras warns and skips the update; so do we
            counts = self.state.counts
            counts.add(counts.delta(micro_steps=1))
        return logs

    def _micro_step(self, micro):
        """Adds a `MicroBatch` to the window (or leaves it out); ends a full window."""
        state, replicas, model = self.state, self.devices, self.model
        self.configuration.reduction.check(model)
        replicas.check(micro)
        state.track(micro, replicas.create)
        if self.configuration.sparse_rows:
            state.warn_if_densified(micro, "jit_compile=True (XLA needs fixed shapes)"
                                    if model.jit_compile else "several replicas")
        observers = replicas.observers_here()
        seen = state.micro_step(micro)
        totals = replicas.totals_per_micro_batch

        def add():
            delta = state.add(micro, totals)
            tell(observers, "on_micro_step", seen)
            return delta

        def leave_out():
            replicas.leave_out()
            tell(observers, "on_leave_out", seen)
            return state.leave_out(totals)

        if self.skip_nonfinite:
            delta = tf.cond(gradients.all_finite(micro.grads), add, leave_out)
        else:
            delta = add()
        # This update depends on `samples`, so on the micro-batch's data: when
        # a dataset of unknown length runs out, it cannot run before
        # `get_next()` fails (Keras' own `optimizer.iterations` can, and
        # counts a phantom step per epoch that way).
        state.counts.add(delta)
        replicas.after_micro_step()
