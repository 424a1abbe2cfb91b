"""A backup's files: one `.npz` written whole or not at all, and the dashboard cut back to it.

A backup is written to a temporary file, flushed to the disk, then renamed
over the last one (a rename replaces a file atomically), so that a kill at
any moment leaves a whole backup. The dashboard's event files only grow: a
backup records their sizes, and a resumed run cuts them back to those, so
that the points written after the backup (which the resumed run writes
again) are not there twice.
"""

import json
import os
import shutil

import numpy as np

_META = "__meta__"
_EVENTS = "events.out.tfevents"


class BackupFiles:
    """`latest.npz` in `directory` (and `previous.npz` with `double_checkpoint`)."""

    def __init__(self, directory, double_checkpoint):
        self.directory = directory
        self.double_checkpoint = double_checkpoint
        self.latest = os.path.join(directory, "latest.npz")
        self.previous = os.path.join(directory, "previous.npz")

    def write(self, meta, arrays):
        os.makedirs(self.directory, exist_ok=True)
        partial = os.path.join(self.directory, f".partial-{os.getpid()}.npz")
        with open(partial, "wb") as file:
            np.savez(file, **arrays, **{_META: np.asarray(json.dumps(meta))})
            file.flush()
            os.fsync(file.fileno())
        if self.double_checkpoint and os.path.exists(self.latest):
            os.replace(self.latest, self.previous)
        os.replace(partial, self.latest)
        _sync_directory(self.directory)

    def read(self):
        """`(meta, arrays)` of the last whole backup, or `None` where there is none."""
        paths = [self.latest] + [self.previous] * self.double_checkpoint
        error = None
        for path in paths:
            if not os.path.exists(path):
                continue
            try:
                with np.load(path, allow_pickle=False) as stored:
                    arrays = {key: stored[key] for key in stored.files}
                return json.loads(str(arrays.pop(_META))), arrays
            except (OSError, ValueError, KeyError) as caught:  # a damaged file
                error = caught
        if error is not None:
            raise ValueError(f"The backup in {self.directory!r} cannot be read ({error}). "
                             "Delete the directory to start again.") from error
        return None

    def delete(self):
        if os.path.isdir(self.directory):
            shutil.rmtree(self.directory)


def dashboard_sizes(log_dir):
    """`{path under log_dir: size}` of its event files now, or `{}`."""
    if log_dir is None or not os.path.isdir(log_dir):
        return {}
    return {os.path.relpath(path, log_dir): os.path.getsize(path) for path in _events(log_dir)}


def cut_dashboard(log_dir, sizes, backup_time):
    """Cuts `log_dir`'s event files back to a backup's `sizes`; removes those
    another process started after the backup (this process's are kept)."""
    own = f".{os.getpid()}."
    for path in _events(log_dir):
        relative = os.path.relpath(path, log_dir)
        if relative in sizes:
            if os.path.getsize(path) > sizes[relative]:
                os.truncate(path, sizes[relative])
        elif own not in os.path.basename(path) and os.path.getmtime(path) >= backup_time:
            os.remove(path)


def _events(log_dir):
    for root, _, names in os.walk(log_dir):
        for name in sorted(names):
            if name.startswith(_EVENTS):
                yield os.path.join(root, name)


def _sync_directory(directory):
    """Makes the rename itself durable (POSIX; elsewhere a no-op)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
