"""The "Accumulation" dashboard's summaries on JAX: the same series as on TensorFlow.

Inside the compiled step the observer keeps the window's micro-batch
gradient norms and, at each update, the applied gradient's norms (its
device state); after each update the host adds a row of device arrays and
its own counts (no device read), and `write()` turns the rows into event
files with TensorBoard's own writer, without TensorFlow. The tags, kinds
and metadata are `tb_plugin.metadata`'s, so the plugin reads both alike.
"""

import time

import jax.numpy as jnp
import numpy as np
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2
from tensorboard.compat.proto import tensor_pb2
from tensorboard.compat.proto import tensor_shape_pb2
from tensorboard.compat.proto import types_pb2
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from tb_plugin import metadata
from tfaccum.backend.jax.observers import WindowObserver

_SERIES = tuple(name for name, _ in metadata.UPDATE_SERIES)
_PLAIN_SCALAR_TAG = "accumulation/gradient_norm"
# NaN where not defined at an update: not written.
_OPTIONAL = ("noise_scale", "window_loss")


class AccumulationSummaries(WindowObserver):
    """Records what each optimizer update applied and writes it as summaries.

    The arguments and the writing schedule are TensorFlow's
    (`tfaccum.backend.tensorflow.summary.AccumulationSummaries`): rows are
    written at epoch ends, when `capacity` rows wait, and every
    `write_interval` seconds.
    """

    def __init__(self, log_dir, *, scalars=False, capacity=1024, write_interval=30.0, noise=None):
        self.log_dir = str(log_dir)
        self.scalars = scalars
        self.capacity = capacity
        self.write_interval = write_interval
        self.noise = noise
        self.hook = None
        self.lost_rows = 0  # none: rows wait on the host
        self._rows = []  # (host values, device values) per update
        self._writer = None
        self._writer_dir = None
        self._variable_names = None
        self._last_write = time.monotonic()
        self._unwritten_micro_steps = 0

    def __repr__(self):
        return (f"AccumulationSummaries(log_dir={self.log_dir!r}, "
                f"scalars={self.scalars}, write_interval={self.write_interval})")

    # -- inside the compiled step ------------------------------------------------

    def initial(self):
        variables = len(self.hook.model.trainable_variables)
        # Arrays of their own: the state is donated to the compiled step.
        state = {name: jnp.zeros((), jnp.float32) for name in (
            "micro_sum", "micro_max", "micro_count", "micro_mean", "micro_top", "applied")}
        return dict(state, per_variable=jnp.zeros((variables,), jnp.float32))

    def on_micro_step(self, state, step):
        norm = jnp.sqrt(step.squared_norm)
        return dict(state, micro_sum=state["micro_sum"] + norm,
                    micro_max=jnp.maximum(state["micro_max"], norm),
                    micro_count=state["micro_count"] + 1.0)

    def on_apply(self, state, update):
        measured = state["micro_count"] > 0
        nan = jnp.float32(float("nan"))
        zero = jnp.zeros((), jnp.float32)
        per_variable = jnp.sqrt(jnp.stack(update.variable_squares))
        return dict(state, micro_sum=zero, micro_max=zero, micro_count=zero,
                    micro_mean=jnp.where(measured, state["micro_sum"]
                                         / jnp.maximum(state["micro_count"], 1.0), nan),
                    micro_top=jnp.where(measured, state["micro_max"], nan),
                    applied=jnp.sqrt(update.squared_norm), per_variable=per_variable)

    # -- on the host ---------------------------------------------------------------

    def on_install(self, hook):
        super().on_install(hook)
        if self._variable_names is None:
            self._variable_names = [v.path for v in hook.model.trainable_variables]

    def on_uninstall(self, hook):
        self.flush()

    def on_reset(self):
        state = self.state() if self.hook is not None else None
        if state is not None:
            self.hook.set_observer_state(self, dict(state, **{
                name: jnp.zeros((), jnp.float32)
                for name in ("micro_sum", "micro_max", "micro_count")}))

    def after_apply(self, iterations, window, counts):
        """Adds the row of the update just made (device values are not read yet).

        Args:
            iterations: `optimizer.iterations` after the update.
            window: The window's counts (`window_*`), host integers.
            counts: The hook's counts after the update.
        """
        state = self.state()
        noise = jnp.float32(float("nan"))
        if self.noise is not None and self.noise.state() is not None:
            noise = self.noise.current()
        device = jnp.concatenate([
            jnp.stack([state["applied"], state["micro_mean"], state["micro_top"], noise]),
            state["per_variable"]])  # a copy: the state is donated to the next step
        host = {"window_micro_batches": window["window_micro_batches"],
                "window_samples": window["window_samples"],
                "window_items": window["window_items"],
                "micro_steps": counts["micro_steps"],
                "skipped_updates": counts["micro_steps"] - counts["optimizer_steps"],
                "nonfinite_skips": counts["nonfinite_skips"]}
        self._rows.append((iterations, host, device))

    def on_batch_end(self, micro_steps, headroom):
        """Writes when `capacity` rows could wait or `write_interval` has passed."""
        self._unwritten_micro_steps += micro_steps
        if self._unwritten_micro_steps >= headroom:
            self.write()
        elif time.monotonic() - self._last_write >= self.write_interval:
            self.flush()

    def _get_writer(self):
        if self._writer is not None and self._writer_dir != self.log_dir:
            self._writer.close()
            self._writer = None
        if self._writer is None:
            self._writer_dir = self.log_dir
            self._writer = EventFileWriter(self.log_dir, max_queue_size=100_000,
                                           flush_secs=60)
        return self._writer

    def write(self):
        """Writes the waiting rows as summaries (one device read for all of them)."""
        self._unwritten_micro_steps = 0
        self._last_write = time.monotonic()
        if not self._rows:
            return
        rows, self._rows = self._rows, []
        device = np.asarray(jnp.stack([row[2] for row in rows]), np.float32)
        writer = self._get_writer()
        metas = {name: metadata.create_summary_metadata(kind)
                 for name, kind in metadata.UPDATE_SERIES}
        plain = scalar_metadata.create_summary_metadata(
            display_name="", description="Applied gradient norm (tfaccum).")
        for (step, host, _), values in zip(rows, device):
            measured = dict(zip(("applied_gradient_norm", "micro_norm_mean", "micro_norm_max",
                                 "noise_scale"), values[:4]))
            points = dict(host, **measured, window_loss=float("nan"))
            for name in _SERIES:
                value = float(points[name])
                if name in _OPTIONAL and not np.isfinite(value):
                    continue
                writer.add_event(_event(metadata.TAG_PREFIX + name, value, step, metas[name]))
            for name, norm in zip(self._variable_names, values[4:]):
                writer.add_event(_event(
                    metadata.ACCUMULATOR_PREFIX + name, float(norm), step,
                    metadata.create_summary_metadata(metadata.Kind.ACCUMULATOR_NORM,
                                                     variable=name)))
            if self.scalars:
                writer.add_event(_event(_PLAIN_SCALAR_TAG, float(values[0]), step, plain))

    def write_leftover(self, step, policy, window, micro_steps, updates, nonfinite):
        """Writes one leftover event and the counters at that moment (as TensorFlow's)."""
        self.write()  # earlier steps first: each series' steps must not go back
        points = metadata.leftover_points(policy, window, micro_steps, updates, nonfinite)
        writer = self._get_writer()
        for name, kind, value in points:
            writer.add_event(_event(metadata.TAG_PREFIX + name, float(value), step,
                                    metadata.create_summary_metadata(kind)))

    def flush(self):
        """Writes waiting rows and flushes the event file to disk."""
        self.write()
        if self._writer is not None:
            self._writer.flush()

    def close(self):
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _event(tag, value, step, summary_metadata):
    """A scalar tensor summary event, as `tf.summary.write` makes one."""
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[value],
                                    tensor_shape=tensor_shape_pb2.TensorShapeProto())
    value = summary_pb2.Summary.Value(tag=tag, metadata=summary_metadata, tensor=tensor)
    return event_pb2.Event(wall_time=time.time(), step=int(step),
                           summary=summary_pb2.Summary(value=[value]))


def probe_log_dir(log_dir):
    """Makes `log_dir` and writes a file in it, or says why it cannot (before training)."""
    import os

    probe = os.path.join(log_dir, f".tfaccum-probe-{os.getpid()}")
    try:
        os.makedirs(log_dir, exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        raise ValueError(
            f"`log_dir` cannot hold the summaries: {type(error).__name__}: "
            f"{error}. Received: log_dir={log_dir!r}") from error
