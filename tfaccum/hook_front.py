"""What every backend's `AccumulationHook` shares: installing, removing, counters.

A backend's hook subclasses `HookFront` and provides `_make(model, api,
configuration, observers, accumulation_steps)` (what it builds, after the
model and the arguments were checked here), `installation` (its
`ModelInstallation`: `install()`, `uninstall()`, `can_reinstall()`,
`installed`, `loop_running`), `counts` (a store whose `numpy()` reads them),
`pending`, `flush()`, `drop()`, `accumulation_steps`, `_install()` and
`_zero()` (the counters and window emptied, for `reinstall()`).
"""

from __future__ import annotations

from tfaccum import _keras
from tfaccum import checks
from tfaccum import observing
from tfaccum.configuration import Configuration
from tfaccum.counts import Counters
from tfaccum.counts import Window
from tfaccum.counts import with_counter_properties
from tfaccum.install import warn_if_discarded
from tfaccum.patching import installed_on


@with_counter_properties
class HookFront:
    """Makes a compiled model update its weights once per window of micro-batches.

    `tfaccum.AccumulationHook` is this class's subclass for the backend Keras
    runs on (`tfaccum.backend.<name>.hook.AccumulationHook`); the callback
    and `install_accumulation_hook` make it.

    Creating the hook installs it: the gradients the model's train step
    hands its optimizer are summed, and the optimizer updates once every
    `accumulation_steps` micro-batches with the large batch's gradient. A
    window that is not full waits for `flush()` or `drop()`; `remove()`
    restores the plain model exactly. Counters are read from the device
    only when asked for: `hook.counters` (a `Counters`, all at once) or one
    by one as properties (`hook.micro_steps`, `optimizer_steps`, `flushes`,
    `dropped_micro_steps`, `nonfinite_skips`, `samples`, `items`).

    What differs per backend (anything not served is refused by name when
    the hook is made, before the model changes):

    - TensorFlow (Keras 3 and tf_keras): a `train_step` of your own is
      accumulated (it applies through `self.optimizer` once per step);
      sparse gradients stay rows; `tf.distribute` replicas and workers.
      With several workers, `pending`, `flush()` and `drop()` communicate
      across them: where one worker calls one, every worker must (its
      samples are summed over replicas).
    - JAX: Keras' `train_step` (override `compute_loss`), one device or
      `keras.distribution.DataParallel`.
    - PyTorch: Keras' `train_step`, one device, `jit_compile=False`, no
      window-wide losses yet.

    Args:
        model (keras.Model): A compiled Keras model.
        accumulation_steps: Micro-batches per optimizer update: an integer >= 1.
            Change it between steps with `set_accumulation_steps()`.
        reduction: As `GradientAccumulationCallback`'s. Defaults to `"auto"`.
        skip_nonfinite: As `GradientAccumulationCallback`'s. Defaults to `None`.
        sparse_gradients: As `GradientAccumulationCallback`'s. Defaults to
            `"rows"`.
        accumulator_dtype: As `GradientAccumulationCallback`'s. Defaults to
            `"float32"`.

    Example:

    ```python
    hook = tfaccum.install_accumulation_hook(model, accumulation_steps=4)
    for x_batch, y_batch in micro_batches:
        model.train_on_batch(x_batch, y_batch)
    hook.flush()   # apply a partial last window
    hook.remove()  # back to a plain Keras model
    ```

    It is also a context manager that flushes and removes itself on exit:

    ```python
    with tfaccum.install_accumulation_hook(model, accumulation_steps=4):
        model.fit(x, y, batch_size=8, epochs=3)
    ```
    """

    # Said in `repr` beside the counters (TensorFlow's says nothing).
    backend_name = None

    def __init__(self, model, *, accumulation_steps: int, reduction: str = "auto",
                 skip_nonfinite: bool | None = None, sparse_gradients: str = "rows",
                 accumulator_dtype: str = "float32"):
        self._resolve_and_make(model, (), accumulation_steps=accumulation_steps,
                               reduction=reduction, skip_nonfinite=skip_nonfinite,
                               sparse_gradients=sparse_gradients,
                               accumulator_dtype=accumulator_dtype)

    @classmethod
    def watched_by(cls, model, observers, **arguments):
        """A hook whose window `observers` watch (the summaries, the noise
        scale, `AccumBatchNormalization`'s statistics): what
        `install_accumulation_hook` makes. `arguments` are `__init__`'s."""
        hook = cls.__new__(cls)
        hook._resolve_and_make(model, observers, **arguments)
        return hook

    def _resolve_and_make(self, model, observers, *, accumulation_steps, **options):
        api = _keras.api_for_model_argument(model, "model")
        checks.check_compiled(model, api, installed_on(model))
        configuration = Configuration.resolve(
            **options, observers=[type(observer) for observer in observers])
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

    # -- what each backend provides -----------------------------------------------------

    @property
    def accumulation_steps(self) -> int:
        """The window's length now: micro-batches per optimizer update."""
        raise NotImplementedError

    def set_accumulation_steps(self, accumulation_steps: int):
        """Sets the window length used from the next micro-batch on."""
        raise NotImplementedError

    @property
    def pending(self) -> Window:
        """The `Window` accumulated but not yet applied."""
        raise NotImplementedError

    def flush(self) -> Window:
        """Applies a partial window now, normalised by what it holds.

        Returns:
            The `Window` that was applied (`Window(0, 0)` if none was pending).
        """
        raise NotImplementedError

    def drop(self) -> Window:
        """Discards a partial window; it is counted in `dropped_micro_steps`.

        Returns:
            The `Window` that was discarded.
        """
        raise NotImplementedError

    # -- alike on every backend --------------------------------------------------------

    @property
    def installed(self) -> bool:
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
