"""What a hook sets on its model, and the two train functions it swaps.

`ModelInstallation` holds the hook's instance patches (`tfaccum.patching`)
and the model's train functions: the accumulating one, traced once, and the
plain one it puts back.
"""

import tensorflow as tf

from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.patching import Installation
from tfaccum.patching import InstancePatch


class ModelInstallation(Installation):
    """What a hook sets on its model while installed, and how it is undone.

    It patches the model's `train_step` with `train_step` and marks the model
    as `owner`'s (`installed_on`). `install()` applies the patches and makes
    the accumulating train function the model's (traced at the first
    install, reused while the model compiles to the same thing);
    `uninstall()` restores the patches and the plain train function the
    model had, if it still compiles to it.

    Args:
        model: The compiled Keras model.
        train_step: The accumulating `train_step(data)`.
        owner: The hook.
    """

    def __init__(self, model, train_step, owner):
        self.train_step_patch = InstancePatch(model, "train_step", train_step)
        super().__init__(model, [self.train_step_patch], owner)
        self._api = _keras_on_tf.api_for(model)
        self._train_function = None  # the accumulating one, once traced
        self._plain_function = None
        self._plain_state = None

    def original_train_step(self):
        """The model's own `train_step` (Keras' default, or an override)."""
        return self.train_step_patch.original()

    def compiled_state(self):
        """What a compiled train function depends on, besides the hook."""
        model = self.model
        with tf.init_scope():  # also while a step traces (a host read)
            return (
                model.optimizer,
                _keras_on_tf.compile_config(model),
                self._api.steps_per_execution(model),
                model.jit_compile,
                model.run_eagerly,
                tuple(id(v) for v in model.trainable_variables),
            )

    def install(self):
        model = self.model
        self._plain_function = model.train_function
        self._plain_state = self.compiled_state()
        for patch in self.patches:
            patch.apply()
        if self._train_function is None:
            model.make_train_function(force=True)
            self._train_function = model.train_function
            self._compiled_for = self.compiled_state()
        else:
            model.train_function = self._train_function
        self.installed = True

    def uninstall(self):
        super().uninstall()
        model = self.model
        if self.compiled_state() == self._plain_state:
            model.train_function = self._plain_function
        else:
            model.train_function = None  # the next `fit` makes a plain one
        self._plain_function = None
