"""Installing a hook on a model: instance attributes set, and put back as they were.

The hook changes no class: it sets instance attributes (the model's
`train_step`, the optimizer's `apply` while a step traces, ...) and, when it
is done, restores exactly what the instance held before: a user's own
instance attribute comes back, an absent one is deleted again.
`ModelInstallation` holds what one hook set on its model, and the two train
functions (the accumulating one, traced once, and the plain one it puts back).
"""

import contextlib
import threading

import tensorflow as tf

from tfaccum import _keras

_ABSENT = object()


class InstancePatch:
    """Sets `name` on `target` itself (its `__dict__`), undone by `restore()`.

    Bypasses the target's `__setattr__` (Keras layers track what is set on
    them) so that nothing but the attribute changes.
    """

    def __init__(self, target, name, value):
        self.target = target
        self.name = name
        self.value = value
        self.previous = _ABSENT
        self.applied = False

    def apply(self):
        if self.applied:
            return
        self.previous = self.target.__dict__.get(self.name, _ABSENT)
        object.__setattr__(self.target, self.name, self.value)
        self.applied = True

    def restore(self):
        if not self.applied:
            return
        if self.previous is _ABSENT:
            if self.target.__dict__.get(self.name) is self.value:
                object.__delattr__(self.target, self.name)
        else:
            object.__setattr__(self.target, self.name, self.previous)
        self.previous = _ABSENT
        self.applied = False

    def original(self):
        """What `target.name` was before the patch (or is, when not applied)."""
        if self.applied:
            if self.previous is not _ABSENT:
                return self.previous
            return getattr(type(self.target), self.name).__get__(self.target)
        return getattr(self.target, self.name)


class SharedPatches:
    """Instance patches held while at least one thread is inside `active()`.

    `tf.distribute.MirroredStrategy` traces each replica's step in a thread of
    its own, at the same time: the patches go on when the first enters and
    come off when the last leaves.
    """

    def __init__(self, patches):
        self.patches = list(patches)
        self._lock = threading.Lock()
        self._depth = 0

    @contextlib.contextmanager
    def active(self):
        with self._lock:
            if not self._depth:
                for patch in self.patches:
                    patch.apply()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if not self._depth:
                    for patch in reversed(self.patches):
                        patch.restore()


_HOOK_ATTRIBUTE = "_tfaccum_hook"


def installed_on(model):
    """The hook installed on `model` (its `ModelInstallation`'s owner), or `None`."""
    return model.__dict__.get(_HOOK_ATTRIBUTE)


class ModelInstallation:
    """What a hook sets on its model while installed, and how it is undone.

    It patches the model's `train_step` with `train_step` and marks the model
    as `owner`'s (`installed_on`). `install()` applies the patches and makes
    the accumulating train function the model's (traced at the first
    install, reused while the model compiles to the same thing);
    `uninstall()` restores the patches and the plain train function the
    model had, if it still compiles to it. Whoever scopes the hook to a
    `fit` holds patches of its own here (`hold`) and says whether that
    `fit`'s loop runs (`loop_running`).

    Args:
        model: The compiled Keras model.
        train_step: The accumulating `train_step(data)`.
        owner: The hook.
    """

    def __init__(self, model, train_step, owner):
        self.model = model
        self.train_step_patch = InstancePatch(model, "train_step", train_step)
        self.patches = [self.train_step_patch, InstancePatch(model, _HOOK_ATTRIBUTE, owner)]
        self.installed = False
        # Whether a `fit` that owns the hook is in its training loop: `None`
        # for a hook installed by hand (any running `fit` counts).
        self.loop_running = None
        self._api = _keras.api_for(model)
        self._train_function = None  # the accumulating one, once traced
        self._compiled_for = None
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
                _keras.compile_config(model),
                self._api.steps_per_execution(model),
                model.jit_compile,
                model.run_eagerly,
                tuple(id(v) for v in model.trainable_variables),
            )

    def hold(self, patch):
        """Holds one more patch while installed (applied now if installed)."""
        self.patches.append(patch)
        if self.installed:
            patch.apply()
        return patch

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

    def can_reinstall(self):
        """Whether the traced train function still fits the model."""
        if self.installed or self._compiled_for is None or installed_on(self.model):
            return False
        current = self.compiled_state()
        return all(a is b or a == b for a, b in zip(current, self._compiled_for))

    def uninstall(self):
        for patch in reversed(self.patches):
            patch.restore()
        model = self.model
        if self.compiled_state() == self._plain_state:
            model.train_function = self._plain_function
        else:
            model.train_function = None  # the next `fit` makes a plain one
        self._plain_function = None
        self.installed = False
