"""What every backend's `AccumulationHook` shares: installing, removing, counters.

A backend's hook subclasses `HookFront` and provides `_make(model, api,
configuration, observers, accumulation_steps)` (what it builds, after the
model and the arguments were checked here), `installation` (its
`ModelInstallation`: `install()`, `uninstall()`, `can_reinstall()`,
`installed`, `loop_running`), `counts` (a store whose `numpy()` reads them),
`pending`, `flush()`, `drop()`, `accumulation_steps`, `_install()` and
`_zero()` (the counters and window emptied, for `reinstall()`).
"""

from tfaccum import _keras
from tfaccum import checks
from tfaccum import observing
from tfaccum.configuration import Configuration
from tfaccum.counts import Counters
from tfaccum.counts import with_counter_properties
from tfaccum.install import warn_if_discarded
from tfaccum.patching import installed_on


@with_counter_properties
class HookFront:
    """The public surface of an accumulation hook, alike on every backend."""

    # Said in `repr` beside the counters (TensorFlow's says nothing).
    backend_name = None

    def __init__(self, model, *, accumulation_steps, reduction="auto", skip_nonfinite=None,
                 sparse_gradients="rows", accumulator_dtype="float32", observers=()):
        api = _keras.api_for_model_argument(model, "model")
        checks.check_compiled(model, api, installed_on(model))
        configuration = Configuration.resolve(
            reduction=reduction, skip_nonfinite=skip_nonfinite,
            sparse_gradients=sparse_gradients, accumulator_dtype=accumulator_dtype,
            observers=[type(observer) for observer in observers])
        self._make(model, api, configuration, observers, accumulation_steps)

    @classmethod
    def made_with(cls, model, configuration, observers, *, accumulation_steps):
        """A hook of a resolved `Configuration`, with its `observers` made (the callback's)."""
        api = _keras.api_for_model_argument(model, "model")
        checks.check_compiled(model, api, installed_on(model))
        hook = cls.__new__(cls)
        hook._make(model, api, configuration, observers, accumulation_steps)
        return hook

    @staticmethod
    def installed_on(model):
        """The hook installed on `model`, or `None`."""
        return installed_on(model)

    @property
    def installed(self):
        """Whether the hook is installed on its model now."""
        return self.installation.installed

    def can_reinstall(self):
        """Whether `reinstall()` can reuse this hook's compiled step.

        True unless the hook is installed, the model was compiled again, or
        its trainable variables or execution settings changed since.
        """
        return self.installation.can_reinstall()

    def reinstall(self):
        """Installs this hook again with zeroed counters, reusing its compiled step.

        Saves compiling the train function again when the same model is
        fitted again (for example `fit` called once per epoch).
        """
        checks.check_reinstallable(self.can_reinstall(), self.model)
        self._zero()
        observing.tell(self.observers, "on_reset")  # the window is emptied, on the host
        self._install()

    def remove(self):
        """Restores the plain model. Warns if a window was left pending.

        Raises an error when called while the model's `fit` is running (from
        a callback): the running `fit` needs the train function it has.
        """
        if not self.installed:
            return
        checks.check_removable(self.installation.loop_running, self.model)
        warn_if_discarded(self.pending)
        self.uninstall()

    def uninstall(self):
        """Puts the model back as it was, whatever is pending; observers are told first.

        The model is restored even if an observer raises (e.g. summaries
        that cannot be written); the error then propagates.
        """
        try:
            for observer in self.observers:
                observer.on_uninstall(self)
        finally:
            self.installation.uninstall()

    # -- backups (`tfaccum.BackupAndRestore`) ---------------------------------------------

    window_backup = None  # a backend's module: `read(hook)`, `restore(hook, state)`, `refusal(hook)`

    def window_state(self):
        """The open window, the counters and the observers' states, as
        `{name: numpy array}` (read between micro-steps): what a backup holds
        of the hook."""
        return self.window_backup.read(self)

    def restore_window_state(self, state):
        """Sets a `window_state()` on this hook, which a new `fit` installed, before
        its first micro-step: the window goes on as if never interrupted. A state
        that does not fit is a `ValueError` naming its entry; nothing changes."""
        self.window_backup.restore(self, state)

    def backup_refusal(self):
        """What this hook cannot hold in a backup mid-window (a phrase), or `None`."""
        return self.window_backup.refusal(self)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if exc_type is None:
            self.flush()
        else:
            self.drop()
        self.remove()
        return False

    @property
    def counters(self):
        """The counters now, as one `Counters` snapshot (a single device read)."""
        return Counters.read(self.counts)

    def __repr__(self):
        counters = self.counters
        backend = "" if self.backend_name is None else f", backend={self.backend_name!r}"
        return (f"AccumulationHook(model={self.model.name!r}, "
                f"accumulation_steps={self.accumulation_steps}, "
                f"reduction={self.reduction!r}, installed={self.installed}, "
                f"micro_steps={counters.micro_steps}, "
                f"optimizer_steps={counters.optimizer_steps}{backend})")
