"""What a hook sets on a model on PyTorch: its train function, put back when removed."""

from tfaccum.patching import Installation
from tfaccum.patching import InstancePatch


class ModelInstallation(Installation):
    """The hook's instance patches: `model.train_function` and the hook's mark.

    Keras' PyTorch trainer keeps a train function it already has and reads
    `model.train_function` at every batch: the accumulating one takes its
    place while installed, and Keras' own comes back after.

    Args:
        model: The compiled Keras model.
        train_function: The accumulating `train_function(data)`.
        owner: The hook.
    """

    def __init__(self, model, train_function, owner):
        super().__init__(model, [InstancePatch(model, "train_function", train_function)], owner)
        self._compiled_for = self.compiled_state()

    def compiled_state(self):
        """What the hook's step depends on, besides the hook."""
        model = self.model
        return (model.optimizer, model.jit_compile, model.run_eagerly,
                tuple(id(v) for v in model.trainable_variables))
