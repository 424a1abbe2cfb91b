"""Installing a hook on a model: instance attributes set, and put back as they were.

The hook changes no class: it sets instance attributes (the model's
`train_step`, the optimizer's `apply` while a step traces, ...) and, when it
is done, restores exactly what the instance held before: a user's own
instance attribute comes back, an absent one is deleted again.
A backend's installation (`Installation`'s subclass in each backend
package) holds what one hook set on its model, with the train function it
swaps in.
"""

import abc
import contextlib
import threading

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


HOOK_ATTRIBUTE = "_tfaccum_hook"


def installed_on(model):
    """The hook installed on `model` (its installation's owner), or `None`."""
    return model.__dict__.get(HOOK_ATTRIBUTE)


class Installation(abc.ABC):
    """What a hook sets on its model while installed, and how it is undone.

    Holds the hook's instance patches, the hook's mark among them
    (`installed_on`). Whoever scopes the hook to a `fit` holds patches of
    its own here (`hold`) and says whether that `fit`'s loop runs
    (`loop_running`). A backend's subclass says what its compiled functions
    depend on (`compiled_state`, recorded in `_compiled_for` once they are
    made) and swaps its train function in and out.

    Args:
        model: The compiled Keras model.
        patches: The hook's `InstancePatch`es.
        owner: The hook.
    """

    def __init__(self, model, patches, owner):
        self.model = model
        self.patches = [*patches, InstancePatch(model, HOOK_ATTRIBUTE, owner)]
        self.installed = False
        # Whether a `fit` that owns the hook is in its training loop: `None`
        # for a hook installed by hand (any running `fit` counts).
        self.loop_running = None
        self._compiled_for = None

    @abc.abstractmethod
    def compiled_state(self):
        """What the hook's compiled functions depend on, besides the hook (a tuple)."""

    def hold(self, patch):
        """Holds one more patch while installed (applied now if installed)."""
        self.patches.append(patch)
        if self.installed:
            patch.apply()
        return patch

    def release(self, patch):
        """Restores a held patch and holds it no more."""
        patch.restore()
        self.patches.remove(patch)

    def install(self):
        for patch in self.patches:
            patch.apply()
        self.installed = True

    def uninstall(self):
        for patch in reversed(self.patches):
            patch.restore()
        self.installed = False

    def can_reinstall(self):
        """Whether the compiled functions still fit the model."""
        if self.installed or self._compiled_for is None or installed_on(self.model):
            return False
        current = self.compiled_state()
        return all(a is b or a == b for a, b in zip(current, self._compiled_for))


class TrainFunctionInstallation(Installation):
    """The hook's instance patches where Keras reads `model.train_function` at
    every batch (its JAX and PyTorch trainers): the accumulating one takes its
    place while installed, and Keras' own comes back after.

    Args:
        model: The compiled Keras model.
        train_function: The accumulating train function, called as Keras' is.
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
