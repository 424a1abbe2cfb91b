"""Keras 2 (`tf_keras`): every way it differs from Keras 3.

`tf_keras` is never imported here but inside a method that only a tf_keras
model reaches: a model can only be one once its user has imported it.
"""

import contextlib

import tensorflow as tf

from tfaccum._keras.models import compiled_with_optimizer
from tfaccum._keras.models import flatten_layers
from tfaccum._keras.models import metrics_given
from tfaccum._keras.models import regularized_variables
from tfaccum._keras.models import scales_loss_dynamically


class TfKeras:
    """Keras 2 (`tf_keras`): `train_step` calls `optimizer.minimize()`.

    `minimize()` computes the gradients (unscaled again under mixed precision)
    and passes them to `apply_gradients()`, which also all-reduces them across
    replicas.
    """

    # Gradient caching: built for Keras 3 only across replicas and under a
    # LossScaleOptimizer (refused by name on tf_keras).
    gathers_across_replicas = False
    caches_under_loss_scaling = False
    apply_method = "apply_gradients"
    scales_loss_in_step = False
    loss_method = "minimize"

    @staticmethod
    def is_compiled(model):
        # Private: `Model._is_compiled` (tf_keras 2.16-2.21).
        return compiled_with_optimizer(model, "_is_compiled")

    @staticmethod
    def steps_per_execution(model):
        # Private: `Model._steps_per_execution` (tf_keras 2.16-2.21).
        steps = getattr(model, "_steps_per_execution", None)
        return 1 if steps is None else int(steps.numpy())

    @staticmethod
    def apply_arguments(grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs):
        if skip_gradients_aggregation or not kwargs.get(
            "experimental_aggregate_gradients", True
        ):
            raise ValueError(
                "Gradient accumulation all-reduces the window's gradients "
                "once, when it is applied; it cannot take gradients the "
                "train step already aggregated. Received: "
                "optimizer.apply_gradients(..., skip_gradients_aggregation="
                f"{skip_gradients_aggregation}, **{kwargs})"
            )
        pairs = list(grads_and_vars)
        return [g for g, _ in pairs], [v for _, v in pairs]

    @staticmethod
    def apply(apply_gradients, grads, variables, reduced=False):
        """Calls `apply_gradients`, the optimizer's own (unpatched) method.

        `reduced`: the gradients are already summed over replicas; its own
        aggregation is then switched off by its public argument (new
        optimizers take it as a keyword too).
        """
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if reduced:
            apply_gradients(pairs, experimental_aggregate_gradients=False)
        else:
            apply_gradients(pairs)

    @staticmethod
    def own_reduction_off(optimizer):
        """Nothing to switch off: `apply(..., reduced=True)` says it by argument."""
        return contextlib.nullcontext()

    @staticmethod
    def build_optimizer(optimizer, variables):
        """Creates the optimizer's variables now, outside the update's branch."""
        if hasattr(optimizer, "build"):
            optimizer.build(variables)  # a no-op once built
        else:
            # A legacy optimizer (`tf_keras.optimizers.legacy.*`, or a
            # LossScaleOptimizer over one) has no `build`; private:
            # `OptimizerV2._create_all_weights` (tf_keras 2.16-2.21) makes
            # its iterations, hyperparameters and slots, as its own
            # `apply_gradients` would on the first call.
            optimizer._create_all_weights(variables)

    @staticmethod
    def built_in_accumulation_steps(optimizer):
        return None  # tf_keras optimizers have none

    @staticmethod
    def loss_scale(optimizer):
        return None  # `minimize()` hands over unscaled gradients

    @staticmethod
    def count_nonfinite_window(optimizer):
        """A window whose gradients were all non-finite: tf_keras' LossScaleOptimizer
        counts the step it skips in `iterations`."""
        if scales_loss_dynamically(optimizer):
            optimizer.iterations.assign_add(1)

    @staticmethod
    def lower_loss_scale(optimizer):
        if not optimizer.dynamic:
            return None
        # Private: `LossScaleOptimizer._loss_scale` (tf_keras 2.16-2.21), as
        # its own `apply_gradients` does.
        state = optimizer._loss_scale
        state.counter.assign(0)
        state.current_loss_scale.assign(
            tf.maximum(state.current_loss_scale / state.multiplier, 1.0)
        )
        return None  # the window holds unscaled gradients: keep it

    @staticmethod
    def backend():
        """The backend this Keras runs on."""
        return "tensorflow"

    # -- what a model holds ---------------------------------------------------------

    @staticmethod
    def loss_container(model):
        """The object holding the compiled losses (`Model.compiled_loss`, a
        `LossesContainer`, private, 2.16-2.21), or `None`; built before the first
        step under a strategy, else while it traces."""
        return getattr(model, "compiled_loss", None)

    @staticmethod
    def replica_loss_share(model):
        """What tf_keras multiplies each replica's loss by: 1 / replicas."""
        return 1.0 / model.distribute_strategy.num_replicas_in_sync

    @staticmethod
    def regularized_weights(model):
        """Names of the trainable weights that carry a weight regularizer: on the
        variable, or on the layer (`kernel_regularizer` and its kin, public)."""
        names = regularized_variables(model)
        if names:
            return names
        attributes = ("kernel_regularizer", "bias_regularizer", "embeddings_regularizer",
                      "depthwise_regularizer", "pointwise_regularizer",
                      "recurrent_regularizer", "gamma_regularizer", "beta_regularizer")
        return [f"{layer.name}.{attribute}" for layer in flatten_layers(model)
                for attribute in attributes if getattr(layer, attribute, None) is not None]

    @staticmethod
    def has_compiled_metrics(model):
        """Whether `compile` was given `metrics=` or `weighted_metrics=`
        (`Model.compiled_metrics`, private, 2.16-2.21)."""
        container = getattr(model, "_compile_metrics", None)
        return metrics_given(container if container is not None
                             else getattr(model, "compiled_metrics", None))

    # -- gradient caching -------------------------------------------------------------

    @staticmethod
    def seed_states(model):
        """None: tf_keras layers draw from stateful ops (see `random_layers`)."""
        return []

    @staticmethod
    def global_seed_states():
        """None: tf_keras has no global seed generator of Keras 3's kind."""
        return []

    @staticmethod
    def random_layers(model):
        """Names of the layers that draw random numbers a second forward pass cannot
        draw again. Private: `tf_keras.src.engine.base_layer.BaseRandomLayer`
        (2.16-2.21)."""
        from tf_keras.src.engine.base_layer import BaseRandomLayer

        return [layer.name for layer in flatten_layers(model)
                if isinstance(layer, BaseRandomLayer)]

    @staticmethod
    def compiled_loss(model, y, y_pred, sample_weight):
        """The compiled loss of a whole window: `Model.compute_loss` (public), whose
        compiled loss also updates its own loss metric, as the large batch's step."""
        return model.compute_loss(None, y, y_pred, sample_weight)

    @staticmethod
    def track_loss(model, loss, samples):
        """Nothing: the compiled loss updated its metric when `compiled_loss` ran."""
