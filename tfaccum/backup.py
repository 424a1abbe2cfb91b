"""`BackupAndRestore`: Keras' callback of that name, made exact at any micro-batch.

Keras' own backs up the weights and the epoch, and a resumed `fit` starts
the saved epoch from its first batch: the epoch's first windows train twice
and the open window is lost. This one's backup holds, in one file written
atomically, everything a resumed `fit` needs to go on as if it had never
stopped: the model's variables (the random seeds' states among them), the
optimizer's, the epoch's metrics, the accumulation hook's open window and
counters (`hook.window_state()`), and the position in the data. A resumed
`fit` passes over the micro-batches its epoch had trained, without
computing them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings

import numpy as np

from tfaccum import _keras
from tfaccum import backup_files
from tfaccum.patching import InstancePatch
from tfaccum.patching import installed_on

_FORMAT = 1


class BackupAndRestore(_keras.Callback):
    """Backs up training at any micro-batch; a run killed there resumes exactly.

    A drop-in for `keras.callbacks.BackupAndRestore`, with its arguments,
    beside a `GradientAccumulationCallback` (or alone): run the same script
    again after the process was killed, at any moment, and `fit` finishes
    with the weights, `optimizer.iterations`, counters and dashboard series
    of a run that was never interrupted. A backup holds the model's and the
    optimizer's variables, the epoch's metrics, the open window
    (accumulators, counts, what `leftover="carry"` kept), the noise scale's
    estimates and the position in the data (epoch, micro-batch). It is
    written to a new file that then replaces the last one, so a kill during
    a backup leaves the previous one whole. On SIGTERM (what spot machines,
    TPU and SLURM send before they stop a process) a backup is taken at the
    end of the current micro-batch and `fit` returns; run the script again to
    go on from there. Keras 3, on every backend (a tf_keras model is
    refused by name).

    Exact for data read in the same order by every run: arrays and
    `keras.utils.PyDataset` with `shuffle=False`, finite `tf.data` pipelines
    of deterministic order. `shuffle=True` and `steps_per_epoch` (epochs
    that continue one stream of the data) are warned about when `fit` starts.

    Args:
        backup_dir: Directory for the backup (`latest.npz`; with
            `double_checkpoint`, `previous.npz`). Not to be shared with
            another run or callback.
        save_freq: `"epoch"`, or an integer: a backup every `save_freq`
            micro-batches. Defaults to `"epoch"`.
        double_checkpoint: Keep the backup before the last too, restored
            when the last cannot be read. Defaults to `False`.
        delete_checkpoint: Delete the backup when `fit` completes (not when
            it stopped for SIGTERM). Defaults to `True`.

    Example:

    ```python
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, callbacks=[
        tfaccum.GradientAccumulationCallback(accumulation_steps=4),
        tfaccum.BackupAndRestore("backup", save_freq=10)])
    # killed? run the same script again: it goes on from the last backup
    ```
    """

    def __init__(self, backup_dir: str | os.PathLike, save_freq: str | int = "epoch",
                 double_checkpoint: bool = False, delete_checkpoint: bool = True):
        super().__init__()
        if not backup_dir or not isinstance(backup_dir, (str, os.PathLike)):
            raise ValueError("`backup_dir` must be a non-empty path. "
                             f"Received: backup_dir={backup_dir!r}")
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(
                save_freq, int) or save_freq < 1):
            raise ValueError("`save_freq` must be 'epoch' or an integer >= 1 (micro-batches "
                             f"between backups). Received: save_freq={save_freq!r}")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = bool(double_checkpoint)
        self.delete_checkpoint = bool(delete_checkpoint)
        self.files = backup_files.BackupFiles(self.backup_dir, self.double_checkpoint)
        self.preempted = False
        self._restored = self._metrics = None

    def __repr__(self):
        return (f"BackupAndRestore(backup_dir={self.backup_dir!r}, save_freq={self.save_freq!r}, "
                f"double_checkpoint={self.double_checkpoint}, "
                f"delete_checkpoint={self.delete_checkpoint})")

    def set_model(self, model):
        if _keras.is_tf_keras_model(model):
            raise ValueError(
                "tfaccum.BackupAndRestore serves Keras 3; this model is tf_keras' (Keras 2). "
                "Use tf_keras.callbacks.BackupAndRestore(save_freq='epoch') there, or Keras 3.")
        super().set_model(model)

    # -- fit's start: restore ---------------------------------------------------------

    def on_train_begin(self, logs=None):
        model = self.model
        self.preempted = False
        self._epoch, self._position, self._since_backup, self._due = 0, 0, 0, False
        self._warn_about_data(_keras.fit_arguments(model))
        self._restored = None
        self._restore_model(self.files.read())
        self._signal = _SigtermNotice.install(model)  # once nothing here can fail

    def _restore_model(self, backup):
        """The model's and optimizer's variables now; the epoch's part when it begins."""
        if backup is None:
            return
        model = self.model
        meta, arrays = backup
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        _check_backup(meta, model)  # before anything is assigned
        accumulation = _accumulation_callback(self)
        if accumulation is None and any(key.startswith("window/") for key in arrays):
            raise ValueError("The backup holds an accumulation window, and this fit has no "
                             "GradientAccumulationCallback. Resume with the callbacks the "
                             "backup was taken with.")
        _assign(model.variables, arrays, "model")
        if model.optimizer is not None:
            _assign(model.optimizer.variables, arrays, "optimizer")
        log_dir = getattr(accumulation, "log_dir", None)
        if log_dir is not None:
            backup_files.cut_dashboard(log_dir, meta["dashboard"], meta["time"])
        self._restored = (meta, arrays)
        _keras.resume_at_epoch(model, meta["epoch"])

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._position, self._passing = epoch, 0, 0
        if self._restored is None:
            return
        meta, _ = self._restored
        if epoch != meta["epoch"]:
            self._restored = None  # `initial_epoch` was given past the backup's: Keras' rule
            return
        self._position = self._passing = meta["micro_batch"]
        if not self._passing:
            self._restore_epoch()
        else:
            self._pass_over(self._passing)

    def on_train_batch_begin(self, batch, logs=None):
        # Mid-epoch, once the epoch's data iterator is made: PyTorch's draws
        # from the generator the window's state restores.
        if self._restored is not None:
            self._restore_epoch()

    def _restore_epoch(self):
        """The epoch's metrics (Keras resets them as an epoch begins) and the window."""
        (meta, arrays), self._restored = self._restored, None
        if meta["micro_batch"]:  # at an epoch's start they are zeros, as Keras reset them
            self._metrics = arrays
            if len(self.model.metrics_variables) == _count(arrays, "metrics"):
                self._restore_metrics()  # else once the first batch passed over made them
        hook = installed_on(self.model)
        window = {key[len("window/"):]: value for key, value in arrays.items()
                  if key.startswith("window/")}
        if hook is not None and window:
            hook.restore_window_state(window)

    def _restore_metrics(self, data=None):
        if data is not None:
            _keras.build_compiled_metrics(self.model, data)
        _assign(self.model.metrics_variables, self._metrics, "metrics")
        self._metrics = None

    def _pass_over(self, batches):
        """Makes the train function take, without computing, the first `batches`
        micro-batches of the epoch (trained before the backup)."""
        model = self.model
        hook = installed_on(model)
        backend = _keras.api_for(model).backend()
        calls = [batches // max(_keras.api_for(model).steps_per_execution(model), 1)]
        patch = InstancePatch(model, "train_function", None)

        def train_function(*args):
            if calls[0] <= 0:
                return patch.original()(*args)
            calls[0] -= 1
            if calls[0] == 0:
                release()
            logs, data = _passed_over(backend, args, model)
            if self._metrics is not None:
                self._restore_metrics(data)
            return logs

        def release():
            if hook is not None:
                hook.installation.release(patch)
            else:
                patch.restore()

        patch.value = train_function
        if hook is not None:
            hook.installation.hold(patch)
        else:
            patch.apply()

    # -- during fit: back up --------------------------------------------------------

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1
        if done <= self._passing:  # passed over: trained before the backup
            return
        self._since_backup += done - max(self._position, self._passing)
        self._position = done
        if self._signal.arrived:
            self._due = True
        elif self.save_freq != "epoch" and self._since_backup >= self.save_freq:
            self._due = True
        if self._due and self._back_up(self._epoch, done):
            if self._signal.arrived:
                self._stop_for_preemption()

    def on_epoch_end(self, epoch, logs=None):
        if self.preempted:  # the epoch was cut short: the backup is where it stopped
            return
        self._position = 0
        if self.save_freq == "epoch" or self._due:
            self._back_up(epoch + 1, 0)

    def on_train_end(self, logs=None):
        self._signal.remove()
        if self.delete_checkpoint and not self.preempted:
            self.files.delete()

    def _back_up(self, epoch, micro_batch):
        """Writes a backup at (`epoch`, `micro_batch`); `False` where the open
        window cannot be held (it waits for the window's end)."""
        model = self.model
        hook = installed_on(model)
        window = {}
        if hook is not None:
            refusal = hook.backup_refusal()
            if refusal is not None and hook.pending.micro_batches:
                return False
            window = hook.window_state()
        accumulation = _accumulation_callback(self)
        summaries = getattr(accumulation, "summaries", None)
        if summaries is not None:
            summaries.flush()  # the series up to here, on disk before the backup names it
        arrays = {}
        arrays.update(_values(model.variables, "model"))
        if model.optimizer is not None:
            arrays.update(_values(model.optimizer.variables, "optimizer"))
        arrays.update(_values(model.metrics_variables, "metrics"))
        arrays.update({"window/" + key: value for key, value in window.items()})
        log_dir = getattr(accumulation, "log_dir", None) if summaries is not None else None
        meta = {"format": _FORMAT, "epoch": epoch, "micro_batch": micro_batch,
                "variables": _shapes(model),
                "backend": _keras.api_for(model).backend(), "time": time.time(),
                "dashboard": backup_files.dashboard_sizes(log_dir)}
        self.files.write(meta, arrays)
        self._since_backup, self._due = 0, False
        return True

    def _stop_for_preemption(self):
        self.preempted = True
        accumulation = _accumulation_callback(self)
        if accumulation is not None:
            accumulation.hold_window()
        self.model.stop_training = True
        _keras.print_msg(f"\nSIGTERM: backed up at epoch {self._epoch + 1}, micro-batch "
                         f"{self._position}; fit stops. Run the script again to resume.")

    def _warn_about_data(self, arguments):
        said = []
        if arguments.get("shuffle") and not _is_dataset(arguments.get("x")):
            said.append("shuffle=True (a resumed epoch is shuffled anew; pass shuffle=False, "
                        "and shuffle the data once before fit)")
        if arguments.get("steps_per_epoch"):
            said.append(f"steps_per_epoch={arguments['steps_per_epoch']} (epochs continue one "
                        "stream of the data, which a resumed fit starts again)")
        if said:
            warnings.warn("tfaccum.BackupAndRestore: a resumed fit will not read the data as "
                          "the interrupted one did, so it will not be exact: "
                          + "; ".join(said) + ".", stacklevel=3)


def _accumulation_callback(callback):
    from tfaccum.callback import GradientAccumulationCallback

    callbacks = _keras.fit_callback_list(callback)
    for other in (callbacks.callbacks if callbacks is not None else ()):
        if isinstance(other, GradientAccumulationCallback):
            return other
    return None


def _is_dataset(x):
    # `shuffle` is ignored for a tf.data dataset (its own order is what it is).
    return type(x).__name__.endswith("Dataset") and hasattr(x, "element_spec")


def _passed_over(backend, args, model):
    """What Keras' train function returns for an execution passed over, and its
    first batch: its data taken from the iterator (TensorFlow, JAX; PyTorch
    hands it over)."""
    steps = _keras.api_for(model).steps_per_execution(model)
    if backend == "torch":
        return {}, args[0][0]
    iterator = args[-1]
    batches = [next(iterator, None) for _ in range(steps)]
    return ({}, args[0]) if backend == "jax" else {}, batches[0]


def _count(arrays, prefix):
    return sum(key.startswith(prefix + "/") for key in arrays)


def _values(variables, prefix):
    return {f"{prefix}/{index}": np.asarray(_keras.variable_numpy(v))
            for index, v in enumerate(variables)}


def _assign(variables, arrays, prefix):
    for index, variable in enumerate(variables):
        variable.assign(arrays[f"{prefix}/{index}"])


def _shapes(model):
    """The shapes of the model's variables, then its optimizer's (`None` between)."""
    optimizer = [] if model.optimizer is None else model.optimizer.variables
    return [list(v.shape) for v in model.variables] + [None] + [
        list(v.shape) for v in optimizer]


def _check_backup(meta, model):
    if meta.get("format") != _FORMAT:
        raise ValueError(f"The backup is of format {meta.get('format')!r}; this tfaccum reads "
                         f"{_FORMAT}. Delete the backup directory to start again.")
    shapes = _shapes(model)
    if meta["variables"] != shapes:
        raise ValueError(
            "The backup was taken of another model: its variables' shapes (then its "
            f"optimizer's, after None) {meta['variables']} are not this model's {shapes}. "
            "Resume with the model and optimizer the backup was taken of, or delete the "
            "backup directory to start again.")


class _SigtermNotice:
    """SIGTERM, while `fit` runs: noted, for a backup at the micro-batch's end."""

    def __init__(self, model):
        self.model = model
        self.arrived = False
        self.previous = None

    @classmethod
    def install(cls, model):
        notice = cls(model)
        if threading.current_thread() is threading.main_thread():
            notice.previous = signal.signal(signal.SIGTERM, notice._handle)
        return notice

    def _handle(self, signum, frame):
        if self.arrived or not _keras.fit_is_running(self.model):
            # A second notice, or a `fit` that ended by an exception: as before.
            self.remove()
            signal.raise_signal(signum)
            return
        self.arrived = True

    def remove(self):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None
