"""What a hook sets on a model on JAX: its train function, put back when removed."""

from tfaccum.backend.jax import _keras_on_jax
from tfaccum.patching import InstancePatch, TrainFunctionInstallation


class ModelInstallation(TrainFunctionInstallation):
    """`model.train_function` swapped in (Keras' JAX trainer makes its own
    before the callbacks' train begins), its compiled steps tied to the
    devices too.

    Args:
        model: The compiled Keras model.
        train_function: The accumulating `train_function(state, iterator)`.
        owner: The hook.
    """

    def __init__(self, model, train_function, owner):
        super().__init__(model, train_function, owner)
        # Whether the train function runs inside `train_on_batch` (`execution_batches`).
        self.one_batch = False
        if _keras_on_jax.STACKS_EXECUTIONS:
            # Keras' `fit` then hands the train function stacked batches, its
            # `train_on_batch` one plain batch, through the same call: told
            # apart here.
            self._keras_train_on_batch = InstancePatch(model, "train_on_batch",
                                                       self._train_on_batch)
            self.patches.insert(0, self._keras_train_on_batch)

    def _train_on_batch(self, *args, **kwargs):
        self.one_batch = True
        try:
            return self._keras_train_on_batch.original()(*args, **kwargs)
        finally:
            self.one_batch = False

    def compiled_state(self):
        """What the compiled functions depend on, besides the hook (the devices too)."""
        return (*super().compiled_state(), _keras_on_jax.distribution())
