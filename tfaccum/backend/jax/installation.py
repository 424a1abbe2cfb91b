"""What a hook sets on a model on JAX: its train function, put back when removed."""

from tfaccum.backend.jax import _keras
from tfaccum.patching import HOOK_ATTRIBUTE
from tfaccum.patching import installed_on
from tfaccum.patching import InstancePatch


class ModelInstallation:
    """The hook's instance patches: `model.train_function` and the hook's mark.

    Keras' JAX trainer makes its train function before the callbacks' train
    begins and reads `model.train_function` at every batch: the accumulating
    one takes its place while installed, and Keras' own comes back after.

    Args:
        model: The compiled Keras model.
        train_function: The accumulating `train_function(state, iterator)`.
        owner: The hook.
    """

    def __init__(self, model, train_function, owner):
        self.model = model
        self.patches = [InstancePatch(model, "train_function", train_function),
                        InstancePatch(model, HOOK_ATTRIBUTE, owner)]
        self.installed = False
        # Whether a `fit` that owns the hook is in its training loop: `None`
        # for a hook installed by hand (any running `fit` counts).
        self.loop_running = None
        self._compiled_for = self.compiled_state()

    def compiled_state(self):
        """What the compiled functions depend on, besides the hook (the devices too)."""
        model = self.model
        return (model.optimizer, model.jit_compile, model.run_eagerly,
                tuple(id(v) for v in model.trainable_variables), _keras.distribution())

    def hold(self, patch):
        """Holds one more patch while installed (applied now if installed)."""
        self.patches.append(patch)
        if self.installed:
            patch.apply()
        return patch

    def install(self):
        for patch in self.patches:
            patch.apply()
        self.installed = True

    def can_reinstall(self):
        """Whether the compiled functions still fit the model."""
        if self.installed or installed_on(self.model):
            return False
        current = self.compiled_state()
        return all(a is b or a == b for a, b in zip(current, self._compiled_for))

    def uninstall(self):
        for patch in reversed(self.patches):
            patch.restore()
        self.installed = False
