"""What a hook sets on a model on JAX: its train function, put back when removed."""

from tfaccum.backend.jax import _keras_on_jax
from tfaccum.patching import TrainFunctionInstallation


class ModelInstallation(TrainFunctionInstallation):
    """`model.train_function` swapped in (Keras' JAX trainer makes its own
    before the callbacks' train begins), its compiled steps tied to the
    devices too.

    Args:
        model: The compiled Keras model.
        train_function: The accumulating `train_function(state, iterator)`.
        owner: The hook.
    """

    def compiled_state(self):
        """What the compiled functions depend on, besides the hook (the devices too)."""
        return (*super().compiled_state(), _keras_on_jax.distribution())
