"""Keras 3 as the TensorFlow backend reads it: `Keras3OnTf`, the core's `Keras3`
and what only this backend needs (its optimizer methods, loss scaling, compiled
losses, seed generators). `api_for(model)` gives it, or `TfKeras`.
"""

import contextlib

import keras

from tfaccum._keras import models
from tfaccum._keras.keras3 import Keras3
from tfaccum._keras.models import flatten_layers
from tfaccum._keras.models import is_tf_keras_model
from tfaccum._keras.models import scales_loss_dynamically


def api_for(model):
    """`Keras3OnTf` or `TfKeras`: what `model` was built with."""
    if is_tf_keras_model(model):
        from tfaccum.backend.tensorflow._keras_on_tf.tf_keras import TfKeras

        return TfKeras
    return Keras3OnTf


class Keras3OnTf(Keras3):
    """Keras 3 on TensorFlow: `train_step` calls `optimizer.scale_loss()` and
    `optimizer.apply()`."""

    # Gradient caching: the window's outputs gathered across replicas, and a
    # window-wide loss under a LossScaleOptimizer.
    gathers_across_replicas = True
    caches_under_loss_scaling = True
    # The optimizer method a train step hands its gradients to.
    apply_method = "apply"
    # Whether the sample weighting can ride on `optimizer.scale_loss()`.
    scales_loss_in_step = True
    # The optimizer method the step's loss passes through.
    loss_method = "scale_loss"


    @staticmethod
    def apply_arguments(grads, trainable_variables=None):
        """`(grads, variables)` from the patched `apply`'s arguments."""
        return list(grads), trainable_variables


    @staticmethod
    def apply(apply, grads, variables, reduced=False):
        """Calls `apply`, the optimizer's own (unpatched) `apply` method.

        `reduced`: the gradients are already summed over replicas
        (`all_reduce_sum`), inside `own_reduction_off`.
        """
        apply(grads, variables)


    @staticmethod
    @contextlib.contextmanager
    def own_reduction_off(optimizer):
        """Switches off the optimizer's all-reduce, in the cross-replica context.

        Keras 3 clips each replica's gradients before summing them; reduced
        by `all_reduce_sum` first, they are clipped as on one device, and
        cross devices once. Private: `_all_reduce_sum_gradients` of the
        TensorFlow optimizer (Keras 3.7-3.16).
        """
        target = getattr(optimizer, "inner_optimizer", None) or optimizer
        if not hasattr(target, "_all_reduce_sum_gradients"):
            raise RuntimeError(
                "This Keras version's optimizer has no `_all_reduce_sum_gradients`; "
                "tfaccum cannot apply a window across replicas with it. Received: "
                f"{type(target).__name__} from Keras {keras.__version__}"
            )
        target.__dict__["_all_reduce_sum_gradients"] = list
        try:
            yield
        finally:
            del target.__dict__["_all_reduce_sum_gradients"]


    @staticmethod
    def build_optimizer(optimizer, variables):
        if not optimizer.built:
            optimizer.build(variables)
            optimizer.built = True


    @staticmethod
    def loss_scale(optimizer):
        """What the gradients the optimizer receives are multiplied by now.

        A float32 tensor read when called, or `None` when they are not scaled.
        """
        if scales_loss_dynamically(optimizer):
            return keras.ops.cast(optimizer.dynamic_scale.value, "float32")
        factor = getattr(optimizer, "loss_scale_factor", None)
        return None if factor is None else keras.ops.convert_to_tensor(factor, "float32")


    @staticmethod
    def count_nonfinite_window(optimizer):
        """A window whose gradients were all non-finite: Keras 3 counts no iteration."""


    @staticmethod
    def lower_loss_scale(optimizer):
        """Halves a dynamic loss scale after a non-finite step, as Keras does.

        Returns the factor to multiply the (scaled) accumulated gradients by.
        """
        optimizer.step_counter.assign(0)
        optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)
        return 0.5


    # -- what a model holds ---------------------------------------------------------

    @staticmethod
    def replica_loss_share(model):
        """What Keras multiplies each replica's loss by under the model's strategy.

        1 / replicas: the replicas' gradients are then summed. Releases without
        `scale_loss_for_distribution` (3.7 among those tested) do not divide:
        each replica's mean loss counts whole. Private:
        `keras.src.losses.loss.scale_loss_for_distribution` (Keras 3.8-3.16).
        """
        from keras.src.losses import loss as keras_loss

        if not hasattr(keras_loss, "scale_loss_for_distribution"):
            return 1.0
        return 1.0 / model.distribute_strategy.num_replicas_in_sync


    # -- gradient caching -------------------------------------------------------------

    @staticmethod
    def seed_states(model):
        """The state variables of the seed generators `model`'s layers draw from.

        A layer that draws random numbers (`Dropout`, `GaussianNoise`, ...)
        draws them from a `SeedGenerator` whose state moves at every draw: set
        back, a forward pass draws the same masks again. Private:
        `Layer._seed_generators` and `SeedGenerator.state` (Keras 3.7-3.16).
        """
        states, seen = [], set()
        for layer in [model] + flatten_layers(model):
            for generator in getattr(layer, "_seed_generators", ()):
                state = generator.state
                if id(state) not in seen:
                    seen.add(id(state))
                    states.append(state)
        return states


    @staticmethod
    def global_seed_states():
        """`[state]` of Keras' global seed generator, made now if it is not yet.

        `keras.random.*` called without a seed draws from it (and moves it):
        set back, a forward pass draws the same numbers again. Call it
        eagerly, so that no step makes it while it traces. Private:
        `keras.src.random.seed_generator.global_seed_generator` (Keras 3.7-3.16).
        """
        from keras.src.random.seed_generator import global_seed_generator

        return [global_seed_generator().state]


    @staticmethod
    def random_layers(model):
        """Layers whose draws cannot be replayed: none (they draw from seed generators)."""
        return []


    @staticmethod
    def compiled_loss(model, y, y_pred, sample_weight):
        """The compiled loss of a whole window: `models.compiled_loss` (under a strategy
        divided by the replicas; no metric updated: `track_loss` does)."""
        return models.compiled_loss(model, y, y_pred, sample_weight)


    @staticmethod
    def track_loss(model, loss, samples):
        """Adds a window's loss to the logs' `loss`, weighted by its samples
        (`models.track_loss`)."""
        models.track_loss(model, loss, samples)
