"""Keras 3's PyTorch trainer, as the PyTorch backend reads it (checked on Keras 3.15-3.16).

The trainer runs eagerly: `fit` calls `model.train_function(data)` with a
list of `steps_per_execution` batches, and `train_step` computes the loss,
calls `backward()` and hands the variables' `.grad` to `optimizer.apply`.
"""

import keras

from tfaccum._keras import models
from tfaccum._keras import private
from tfaccum._keras.models import flatten_layers

# Keras' PyTorch trainer class: `Trainer` from 3.16, `TorchTrainer` in 3.7-3.15.
TRAINER = private.module_attribute("keras.src.backend.torch.trainer", "Trainer", "TorchTrainer")


def forward_and_loss(model, x, y, sample_weight):
    """`(y_pred, loss)` of a training forward pass, as Keras' `train_step` computes
    them (`models.training_arguments`, `models.compiled_loss`)."""
    y_pred = model(x, **models.training_arguments(model))
    model.zero_grad()  # no gradient left from the last micro-batch
    return y_pred, models.compiled_loss(model, y, y_pred, sample_weight, x=x)


def gradients(model):
    """The trainable variables' gradients after `backward()` (`None` where the loss
    did not reach one), as Keras' `train_step` reads them."""
    return [v.value.grad for v in model.trainable_weights]


def release_gradients(model):
    """Lets the variables' `.grad` go (Keras' next `train_step` zeroes them anyway)."""
    for v in model.trainable_weights:
        v.value.grad = None


def own_train_step(model):
    """The class that overrides Keras' PyTorch `train_step`, or `None` (`TRAINER`)."""
    return models.overriding_class(model, TRAINER, "train_step")


def loss_scale_variables(optimizer):
    """`(dynamic_scale, step_counter)` of a `LossScaleOptimizer`, or `None` (public
    attributes of Keras 3's `LossScaleOptimizer`)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.dynamic_scale, optimizer.step_counter
    return None


def halve_loss_scale(optimizer):
    """Halves a dynamic loss scale as Keras does after a non-finite step; `False`
    where `optimizer` scales no loss."""
    scale = loss_scale_variables(optimizer)
    if scale is None:
        return False
    dynamic_scale, step_counter = scale
    dynamic_scale.assign(dynamic_scale * 0.5)
    step_counter.assign(0)
    return True


def loss_scale(optimizer):
    """The loss scale the gradients carry now (1 without a `LossScaleOptimizer`)."""
    scale = loss_scale_variables(optimizer)
    return 1.0 if scale is None else float(keras.ops.convert_to_numpy(scale[0].value))


def toolkit_layers(model):
    """Names of tfaccum's own layers in `model` (a class of tfaccum's among its bases)."""
    return [layer.name for layer in flatten_layers(model)
            if any(cls.__module__.startswith("tfaccum.") for cls in type(layer).__mro__)]


def batch_size(x):
    """The samples of a micro-batch: the first dimension of its first input."""
    return int(keras.tree.flatten(x)[0].shape[0])
