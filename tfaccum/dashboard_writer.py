"""The host side of the "Accumulation" dashboard's summaries, alike on every backend.

A backend's `AccumulationSummaries` records one row per optimizer update
where its step runs (device variables on TensorFlow, the compiled step's
state on JAX) and hands the waiting rows over as host arrays
(`_take_rows`). `DashboardWriter` decides when to write (epoch ends, before
the rows could overflow, every `write_interval` seconds) and writes them as
event files with TensorBoard's own writer, which needs no TensorFlow. The
tags, kinds and metadata are `tfaccum.dashboard_schema`'s, so the plugin reads
every backend's alike.
"""

import abc
import dataclasses
import os
import time

import numpy as np
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2
from tensorboard.compat.proto import tensor_pb2
from tensorboard.compat.proto import tensor_shape_pb2
from tensorboard.compat.proto import types_pb2
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from tfaccum import dashboard_schema
from tfaccum import interrupts

SERIES = tuple(name for name, _ in dashboard_schema.UPDATE_SERIES)
PLAIN_SCALAR_TAG = "accumulation/gradient_norm"
# NaN where not defined at an update: not written.
_OPTIONAL = ("noise_scale", "window_loss")


def variable_name(variable, model_name):
    """A variable's name on the dashboard, alike on every backend: its path
    (Keras 3; tf_keras' name) without the model's name in front."""
    name = getattr(variable, "path", None) or variable.name.split(":")[0]
    prefix = model_name + "/"
    return name[len(prefix):] if model_name and name.startswith(prefix) else name


@dataclasses.dataclass
class UpdateRows:
    """Rows of optimizer updates, on the host.

    Attributes:
        steps: `optimizer.iterations` after each update, shape `(rows,)`.
        series: One column per `SERIES` name, shape `(rows, len(SERIES))`.
        per_variable: Each trainable variable's applied gradient norm,
            shape `(rows, len(variable_names))`.
        variable_names: The variables' names (the dashboard's heat map).
    """

    steps: np.ndarray
    series: np.ndarray
    per_variable: np.ndarray
    variable_names: list


class DashboardWriter(abc.ABC):
    """When and how a backend's recorded updates become event files.

    Args:
        log_dir: Directory to write event files to.
        scalars: Whether to also write the applied gradient norm as a plain
            scalar (`accumulation/gradient_norm`), which TensorBoard's Scalars
            and Time Series tabs show next to the loss.
        capacity: Updates recorded between writes (the device buffer's rows
            on TensorFlow).
        write_interval: Seconds after which recorded rows are written and
            the event file flushed, checked after each batch on the host (no
            device read). Defaults to 30.
        noise: A `NoiseScaleEstimator` whose estimate each row records, or
            `None`.
    """

    def __init__(self, log_dir, *, scalars=False, capacity=1024, write_interval=30.0, noise=None):
        self.log_dir = str(log_dir)
        self.scalars = scalars
        self.capacity = capacity
        self.write_interval = write_interval
        self.noise = noise
        self.lost_rows = 0  # updates whose rows found the buffer full
        self._writer = None
        self._writer_dir = None
        self._last_write = time.monotonic()
        self._unwritten_micro_steps = 0
        # Whether this process writes (JAX: every process records, the first writes).
        self.writes = True

    def __repr__(self):
        return (f"AccumulationSummaries(log_dir={self.log_dir!r}, "
                f"scalars={self.scalars}, write_interval={self.write_interval})")

    def retarget(self, log_dir, *, scalars, write_interval):
        """Writes from now on as a new callback asks (it took over this one's hook)."""
        self.log_dir, self.scalars, self.write_interval = str(log_dir), scalars, write_interval

    @abc.abstractmethod
    def _take_rows(self):
        """The rows recorded since the last write, as `UpdateRows` (emptied), or `None`."""

    def on_batch_end(self, micro_steps, headroom):
        """Writes when the recorded rows could overflow or `write_interval` has passed.

        Args:
            micro_steps: Micro-steps run since the last call (host-counted).
            headroom: Micro-steps that can run before the rows may overflow.
        """
        self._unwritten_micro_steps += micro_steps
        if self._unwritten_micro_steps >= headroom:
            self.write()
        elif time.monotonic() - self._last_write >= self.write_interval:
            self.flush()

    def write(self):
        """Writes the recorded rows as summaries.

        A Ctrl-C waits for the rows taken to be written (they are the only
        copy once taken).
        """
        self._unwritten_micro_steps = 0
        self._last_write = time.monotonic()
        with interrupts.deferred():
            rows = self._take_rows()
            if rows is not None and len(rows.steps):
                self._write_rows(rows)

    def _write_rows(self, rows):
        writer = self._get_writer()
        metas = [dashboard_schema.create_summary_metadata(kind)
                 for _, kind in dashboard_schema.UPDATE_SERIES]
        per_variable = [
            (dashboard_schema.ACCUMULATOR_PREFIX + name, dashboard_schema.create_summary_metadata(
                dashboard_schema.Kind.ACCUMULATOR_NORM, variable=name))
            for name in rows.variable_names]
        plain = scalar_metadata.create_summary_metadata(
            display_name="", description="Applied gradient norm (tfaccum).")
        for step, values, norms in zip(rows.steps, rows.series, rows.per_variable):
            for name, value, meta in zip(SERIES, values, metas):
                if name in _OPTIONAL and not np.isfinite(value):
                    continue
                writer.add_event(_event(dashboard_schema.TAG_PREFIX + name, value, step, meta))
            for (tag, meta), norm in zip(per_variable, norms):
                writer.add_event(_event(tag, norm, step, meta))
            if self.scalars:
                writer.add_event(_event(PLAIN_SCALAR_TAG, values[0], step, plain))

    def write_leftover(self, step, policy, window, micro_steps, updates, nonfinite):
        """Writes one leftover event and the counters at that moment.

        Args:
            step: `optimizer.iterations` now.
            policy: One of `dashboard_schema.LEFTOVER_POLICIES`.
            window: The `Window` flushed, carried or dropped.
            micro_steps: Micro-steps so far in this fit.
            updates: Optimizer updates so far in this fit.
            nonfinite: Micro-batches left out so far in this fit.
        """
        self.write()  # earlier steps first: each series' steps must not go back
        if not self.writes:
            return
        writer = self._get_writer()
        with interrupts.deferred():  # all of the event's points, or none
            for name, kind, value in dashboard_schema.leftover_points(
                    policy, window, micro_steps, updates, nonfinite):
                writer.add_event(_event(dashboard_schema.TAG_PREFIX + name, value, step,
                                        dashboard_schema.create_summary_metadata(kind)))

    def flush(self):
        """Writes recorded rows and flushes the event file to disk."""
        self.write()
        if self._writer is not None:
            self._writer.flush()

    def close(self):
        """Writes, flushes and closes the event file (a later write opens one)."""
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _get_writer(self):
        if self._writer is not None and self._writer_dir != self.log_dir:
            self._writer.close()
            self._writer = None
        if self._writer is None:
            self._writer_dir = self.log_dir
            # Events queue up in memory between the writes at epoch ends.
            self._writer = EventFileWriter(self.log_dir, max_queue_size=100_000,
                                           flush_secs=60)
        return self._writer


def _event(tag, value, step, summary_metadata):
    """A scalar tensor summary event, as `tf.summary.write` makes one."""
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[float(value)],
                                    tensor_shape=tensor_shape_pb2.TensorShapeProto())
    value = summary_pb2.Summary.Value(tag=tag, metadata=summary_metadata, tensor=tensor)
    return event_pb2.Event(wall_time=time.time(), step=int(step),
                           summary=summary_pb2.Summary(value=[value]))


def probe_log_dir(log_dir):
    """Makes `log_dir` and writes a file in it, or says why it cannot (before training).

    Through TensorBoard's file system layer, which the writer uses: local
    paths, and TensorFlow's remote file systems where TensorFlow is installed.
    Without TensorFlow (JAX), TensorBoard's stand-in cannot remove a file: a
    local probe is removed by `os`, a remote directory only made.
    """
    from tensorboard.compat import tf

    gfile = tf.io.gfile
    remove = getattr(gfile, "remove", None)
    if remove is None and "://" not in log_dir:
        remove = os.remove
    probe = f"{log_dir.rstrip('/')}/.tfaccum-probe-{os.getpid()}"
    try:
        gfile.makedirs(log_dir)
        if remove is not None:
            with gfile.GFile(probe, "w") as file:
                file.write("")
            remove(probe)
    except (tf.errors.OpError, OSError) as error:
        raise ValueError(
            f"`log_dir` cannot hold the summaries: {type(error).__name__}: "
            f"{error}. Received: log_dir={log_dir!r}") from error
