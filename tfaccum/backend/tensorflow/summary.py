"""Accumulation summaries for TensorBoard's "Accumulation" dashboard.

The per-update figures are computed inside the model's compiled train step and
kept in a small buffer of device variables (no host round trip per
micro-step, and nothing XLA cannot compile); `write()` turns the buffered rows
into summaries with one call of a TensorFlow function, at epoch ends, before
the buffer can fill and every `write_interval` seconds. The writer is created
at the first write.
"""

import os
import time
import warnings

import tensorflow as tf

from tensorboard.plugins.scalar import metadata as scalar_metadata

from tb_plugin import metadata
from tfaccum.backend.tensorflow import _keras
from tfaccum.backend.tensorflow.gradients import unscaled
from tfaccum.backend.tensorflow.observers import WindowObserver

# Columns of a buffered row, after the step: see metadata.UPDATE_SERIES.
_SERIES = tuple(name for name, _ in metadata.UPDATE_SERIES)
_COLUMNS = ("step",) + _SERIES
_PLAIN_SCALAR_TAG = "accumulation/gradient_norm"
# NaN where not defined at an update: not written.
_OPTIONAL = (metadata.TAG_PREFIX + "noise_scale", metadata.TAG_PREFIX + "window_loss")


class AccumulationSummaries(WindowObserver):
    """Records what each optimizer update applied and writes it as summaries.

    Rows are written when the hook is removed, at every epoch end (by the
    callback), before the device buffer can fill, and when `write_interval`
    seconds have passed since the last write, so that a killed process loses
    at most that much.

    Args:
        log_dir: Directory to write event files to.
        scalars: Whether to also write the applied gradient norm as a plain
            scalar (`accumulation/gradient_norm`), which TensorBoard's Scalars
            and Time Series tabs show next to the loss.
        capacity: Updates buffered on the device between writes.
        write_interval: Seconds after which buffered rows are written and
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
        self._writer = None
        self._writer_dir = None
        self._write_function = None
        self._variable_names = None  # fixed when the train step is traced
        self._columns = None  # of `_norms`: a column per trainable variable
        self._last_write = time.monotonic()
        self._unwritten_micro_steps = 0
        self.lost_rows = 0  # updates whose rows found the buffer full
        # One row more than `capacity`: where an update that finds the
        # buffer full goes (never written out), so that storing a row
        # needs no branch.
        self._rows = _keras.local_variable(
            tf.zeros((capacity + 1, len(_COLUMNS)), tf.float64), "summary_rows"
        )
        self._row_count = _keras.local_variable(tf.zeros((), tf.int64), "summary_row_count")
        # Updates that found the buffer full (none when written in time).
        self._overflow = _keras.local_variable(tf.zeros((), tf.int64), "summary_overflow")
        # Sum and maximum of the micro-batch gradient norms in the window.
        self._micro_norm_sum = _keras.local_variable(0.0, "micro_norm_sum")
        self._micro_norm_max = _keras.local_variable(0.0, "micro_norm_max")
        self._micro_count = _keras.local_variable(0.0, "micro_count")
        self._norms = None  # (capacity, variables), created at installation

    def __repr__(self):
        return (
            f"AccumulationSummaries(log_dir={self.log_dir!r}, "
            f"scalars={self.scalars}, write_interval={self.write_interval})"
        )

    # -- the window protocol (inside the train step) ------------------------------

    def on_micro_step(self, step):
        """Adds one micro-batch's gradient norm (few ops: every micro-step)."""
        norm = tf.sqrt(step.squared_norm)  # 0 where not measured
        self._micro_norm_sum.assign_add(norm)
        self._micro_norm_max.assign(tf.maximum(self._micro_norm_max, norm))
        self._micro_count.assign_add(tf.cast(step.measured, tf.float32))

    def on_install(self, hook):
        # Sized by the model's variables, on the host; a model not built
        # yet gets it at the first trace.
        if self._norms is None and hook.model.trainable_variables:
            self._make_norms(hook.model.trainable_variables)

    def _make_norms(self, variables):
        self._columns = {id(v): i for i, v in enumerate(variables)}
        self._norms = _keras.local_variable(
            tf.zeros((self.capacity + 1, len(variables)), tf.float32),
            "summary_accumulator_norms",
        )

    def on_apply(self, update):
        """Buffers one row for an optimizer update (an `Update`)."""
        present = [(g, v) for g, v in zip(update.grads, update.variables) if g is not None]
        if self._norms is None:
            self._make_norms([v for _, v in present])
        if self._variable_names is None:
            self._variable_names = [
                (_variable_name(v, update.name_prefix), self._columns[id(v)])
                for _, v in present
            ]
        squares = [sq for sq in update.variable_squared_norms if sq is not None]
        present_norms = unscaled(tf.sqrt(tf.stack(squares)), update.gradient_scale)
        norms = tf.scatter_nd(
            [[column] for _, column in self._variable_names],
            present_norms,
            [self._norms.shape[1]],
        )
        window, counts = update.window, update.counts
        micro_steps = counts["micro_steps"]
        updates = counts["optimizer_steps"] + 1
        noise_scale = float("nan") if self.noise is None else self.noise.current()
        measured = self._micro_count > 0
        values = {
            "applied_gradient_norm": tf.norm(present_norms),
            # Not a number where no micro-batch gradient was measured (a
            # window-wide loss has none of its own).
            "micro_norm_mean": tf.where(measured, tf.cast(self._micro_norm_sum, tf.float64)
                                        / tf.cast(tf.maximum(self._micro_count, 1.0), tf.float64),
                                        tf.constant(float("nan"), tf.float64)),
            "micro_norm_max": tf.where(measured, self._micro_norm_max, float("nan")),
            "window_micro_batches": window["window_micro_batches"],
            "window_samples": window["window_samples"],
            "micro_steps": micro_steps,
            "skipped_updates": micro_steps - updates,
            "nonfinite_skips": counts["nonfinite_skips"],
            "noise_scale": noise_scale,
            "window_items": window["window_items"],
            "window_loss": float("nan") if update.loss is None else update.loss,
        }
        row = tf.stack([tf.cast(update.iterations, tf.float64)]
                       + [tf.cast(values[name], tf.float64) for name in _SERIES])
        # A full buffer sends the row to the spare row: never overwrite a
        # stored one; count what was lost, the host warns.
        count = self._row_count.read_value()
        index = tf.minimum(count, self.capacity)
        self._rows.scatter_nd_update([[index]], [row])
        self._norms.scatter_nd_update([[index]], [norms])
        self._row_count.assign(tf.minimum(count + 1, self.capacity))
        self._overflow.assign_add(tf.cast(count >= self.capacity, tf.int64))

    def on_reset(self):
        self._micro_norm_sum.assign(0.0)
        self._micro_norm_max.assign(0.0)
        self._micro_count.assign(0.0)

    def on_uninstall(self, hook):
        self.flush()

    # -- on the host: when to write ------------------------------------------------

    def on_batch_end(self, micro_steps, headroom):
        """Writes when the buffer could fill or `write_interval` has passed.

        Args:
            micro_steps: Micro-steps run since the last call (host-counted).
            headroom: Micro-steps the buffer can take before it may fill.
        """
        self._unwritten_micro_steps += micro_steps
        if self._unwritten_micro_steps >= headroom:
            self.write()
        elif time.monotonic() - self._last_write >= self.write_interval:
            self.flush()

    # -- on the host -----------------------------------------------------------

    def _get_writer(self):
        if self._writer is not None and self._writer_dir != self.log_dir:
            self._writer.close()
            self._writer = None
        if self._writer is None:
            self._writer_dir = self.log_dir
            # Events queue up in memory between the writes at epoch ends.
            self._writer = tf.summary.create_file_writer(
                self.log_dir, max_queue=100_000, flush_millis=60_000
            )
        return self._writer

    def write(self):
        """Writes the buffered rows as summaries and empties the buffer."""
        self._unwritten_micro_steps = 0
        self._last_write = time.monotonic()
        if self._norms is None:
            return
        if self._write_function is None:
            self._write_function = tf.function(self._write_rows, autograph=False)
        if int(self._row_count.numpy()):
            with self._get_writer().as_default():
                self._write_function()
        lost = int(self._overflow.numpy())
        if lost:
            self._overflow.assign(0)
            self.lost_rows += lost
            warnings.warn(
                f"{lost} optimizer updates' summaries found the device buffer "
                f"of {self.capacity} rows full and were not recorded in "
                f"{self.log_dir!r}. Write them more often: call "
                "`summaries.write()` (or train with GradientAccumulationCallback, "
                "which writes in time).",
                stacklevel=2,
            )

    def _write_rows(self):
        series = [
            (metadata.TAG_PREFIX + name, metadata.create_summary_metadata(kind))
            for name, kind in metadata.UPDATE_SERIES
        ]
        per_variable = [
            (
                metadata.ACCUMULATOR_PREFIX + name,
                metadata.create_summary_metadata(
                    metadata.Kind.ACCUMULATOR_NORM, variable=name
                ),
            )
            for name, _ in self._variable_names
        ]
        plain_scalar = scalar_metadata.create_summary_metadata(
            display_name="", description="Applied gradient norm (tfaccum)."
        )
        count = self._row_count.read_value()

        def write_row(i):
            row = tf.cast(self._rows[i], tf.float32)
            step = tf.cast(self._rows[i, 0], tf.int64)
            ops = []
            for column, (tag, meta) in enumerate(series, start=1):
                if tag in _OPTIONAL:  # NaN: not defined at this update
                    ops.append(tf.cond(
                        tf.math.is_finite(row[column]),
                        lambda: _write_scalar(tag, row[column], step, meta),
                        lambda: tf.constant(False),
                    ))
                else:
                    ops.append(_write_scalar(tag, row[column], step, meta))
            for (_, column), (tag, meta) in zip(self._variable_names, per_variable):
                ops.append(_write_scalar(tag, self._norms[i, column], step, meta))
            if self.scalars:
                ops.append(_write_scalar(_PLAIN_SCALAR_TAG, row[1], step, plain_scalar))
            with tf.control_dependencies(ops):
                return [i + 1]

        tf.while_loop(lambda i: i < count, write_row, [tf.constant(0, tf.int64)])
        self._row_count.assign(0)

    def write_leftover(self, step, policy, window, micro_steps, updates, nonfinite):
        """Writes one leftover event and the counters at that moment.

        Args:
            step: `optimizer.iterations` now.
            policy: One of `metadata.LEFTOVER_POLICIES`.
            window: The `Window` flushed, carried or dropped.
            micro_steps: Micro-steps so far in this fit.
            updates: Optimizer updates so far in this fit.
            nonfinite: Micro-batches left out so far in this fit.
        """
        self.write()  # earlier steps first: each series' steps must not go back
        points = metadata.leftover_points(policy, window, micro_steps, updates, nonfinite)
        with self._get_writer().as_default():
            for name, kind, value in points:
                _write_scalar(
                    metadata.TAG_PREFIX + name,
                    tf.constant(value, tf.float32),
                    step,
                    metadata.create_summary_metadata(kind),
                )

    def flush(self):
        """Writes buffered rows and flushes the event file to disk."""
        self.write()
        if self._writer is not None:
            self._writer.flush()

    def close(self):
        """Writes, flushes and closes the event file (a later write opens one)."""
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _write_scalar(tag, value, step, summary_metadata):
    return tf.summary.write(
        tag, value, step=step, metadata=summary_metadata.SerializeToString()
    )


def _variable_name(variable, prefix):
    name = getattr(variable, "path", None) or variable.name.split(":")[0]
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def probe_log_dir(log_dir):
    """Makes `log_dir` and writes a file in it, or says why it cannot (before training)."""
    probe = f"{log_dir.rstrip('/')}/.tfaccum-probe-{os.getpid()}"
    try:
        tf.io.gfile.makedirs(log_dir)
        with tf.io.gfile.GFile(probe, "w") as file:
            file.write("")
        tf.io.gfile.remove(probe)
    except (tf.errors.OpError, OSError) as error:
        raise ValueError(
            f"`log_dir` cannot hold the summaries: {type(error).__name__}: "
            f"{error}. Received: log_dir={log_dir!r}"
        ) from error
