"""Accumulation summaries for TensorBoard's "Accumulation" dashboard.

The per-update figures are computed inside the model's compiled train step and
kept in a small ring buffer of device variables (no host round trip per
micro-step, and nothing XLA cannot compile); `write()` turns the buffered rows
into summaries with one call of a TensorFlow function, at epoch ends and
every `capacity` micro-steps. The writer is created at the first write.
"""

import tensorflow as tf

from tensorboard.plugins.scalar import metadata as scalar_metadata

from tb_plugin import metadata
from tfaccum.norms import squared_norm
from tfaccum.norms import unscaled

# Columns of a buffered row, after the step: see metadata.UPDATE_SERIES.
_SERIES = tuple(name for name, _ in metadata.UPDATE_SERIES)
_COLUMNS = ("step",) + _SERIES
_PLAIN_SCALAR_TAG = "accumulation/gradient_norm"
_OPTIONAL = (metadata.TAG_PREFIX + "noise_scale",)


class AccumulationSummaries:
    """Records what each optimizer update applied and writes it as summaries.

    Args:
        log_dir: Directory to write event files to.
        scalars: Whether to also write the applied gradient norm as a plain
            scalar (`accumulation/gradient_norm`), which TensorBoard's Scalars
            and Time Series tabs show next to the loss.
        capacity: Updates buffered on the device between writes.
    """

    def __init__(self, log_dir, *, scalars=False, capacity=1024):
        self.log_dir = str(log_dir)
        self.scalars = scalars
        self.capacity = capacity
        self._writer = None
        self._write_function = None
        self._variable_names = None  # fixed when the train step is traced
        with tf.init_scope():
            self._rows = tf.Variable(
                tf.zeros((capacity, len(_COLUMNS)), tf.float64),
                trainable=False,
                name="summary_rows",
            )
            self._row_count = tf.Variable(
                tf.zeros((), tf.int64), trainable=False, name="summary_row_count"
            )
            # Sum and maximum of the micro-batch gradient norms in the window.
            self._micro_norm_sum = tf.Variable(
                0.0, trainable=False, name="micro_norm_sum"
            )
            self._micro_norm_max = tf.Variable(
                0.0, trainable=False, name="micro_norm_max"
            )
        self._norms = None  # (capacity, variables), created at first trace

    def __repr__(self):
        return f"AccumulationSummaries(log_dir={self.log_dir!r}, scalars={self.scalars})"

    # -- inside the train step ------------------------------------------------

    def on_micro_step(self, norm):
        """Adds one micro-batch's gradient norm (few ops: every micro-step)."""
        self._micro_norm_sum.assign_add(norm)
        self._micro_norm_max.assign(tf.maximum(self._micro_norm_max, norm))

    def on_update(
        self,
        grads,
        variables,
        unscale,
        step,
        window,
        micro_steps,
        updates,
        nonfinite,
        noise_scale=None,
        prefix="",
    ):
        """Buffers one row for an optimizer update.

        Args:
            grads: The normalised gradients passed to the optimizer (or None).
            variables: Their variables.
            unscale: What `grads` are multiplied by (loss scaling), to undo,
                or `None`.
            step: `optimizer.iterations` after this update.
            window: `(micro_batches, samples, nonfinite micro-batches)` the
                window held, int64.
            micro_steps: Micro-steps so far in this fit, int64.
            updates: Optimizer updates so far in this fit, including this one.
            nonfinite: Micro-batches left out so far in this fit, int64.
            noise_scale: The current B_simple estimate (NaN while undefined),
                or None when it is not estimated.
            prefix: Left off the variables' paths (the model's name).
        """
        present = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if self._norms is None:
            self._variable_names = [_variable_name(v, prefix) for _, v in present]
            with tf.init_scope():
                self._norms = tf.Variable(
                    tf.zeros((self.capacity, len(present)), tf.float32),
                    trainable=False,
                    name="summary_accumulator_norms",
                )
        norms = tf.stack(
            [unscaled(tf.sqrt(squared_norm([g])), unscale) for g, _ in present]
        )
        micro_batches = tf.cast(window[0], tf.float64)
        counted = tf.cast(window[0] - window[2], tf.float64)  # finite ones
        row = tf.stack(
            [
                tf.cast(step, tf.float64),
                tf.cast(tf.norm(norms), tf.float64),
                tf.cast(self._micro_norm_sum, tf.float64) / counted,
                tf.cast(self._micro_norm_max, tf.float64),
                micro_batches,
                tf.cast(window[1], tf.float64),
                tf.cast(micro_steps, tf.float64),
                tf.cast(micro_steps - updates, tf.float64),
                tf.cast(nonfinite, tf.float64),
                tf.cast(
                    float("nan") if noise_scale is None else noise_scale, tf.float64
                ),
            ]
        )
        # The host writes before the buffer can fill; never index past it.
        index = tf.minimum(self._row_count.read_value(), self.capacity - 1)
        self._rows.scatter_nd_update([[index]], [row])
        self._norms.scatter_nd_update([[index]], [norms])
        self._row_count.assign(index + 1)

    def on_window_reset(self):
        self._micro_norm_sum.assign(0.0)
        self._micro_norm_max.assign(0.0)

    # -- on the host -----------------------------------------------------------

    def _get_writer(self):
        if self._writer is None:
            # Events queue up in memory between the writes at epoch ends.
            self._writer = tf.summary.create_file_writer(
                self.log_dir, max_queue=100_000, flush_millis=60_000
            )
        return self._writer

    def write(self):
        """Writes the buffered rows as summaries and empties the buffer."""
        if self._norms is None:
            return
        if self._write_function is None:
            self._write_function = tf.function(self._write_rows, autograph=False)
        with self._get_writer().as_default():
            self._write_function()

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
            for name in self._variable_names
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
            for column, (tag, meta) in enumerate(per_variable):
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
        points = [
            (name, kind, value)
            for (name, kind), value in zip(
                metadata.LEFTOVER_SERIES,
                (metadata.LEFTOVER_POLICIES.index(policy), *window),
            )
        ]
        # Micro-steps after the last update (dropped or carried) count too.
        points += [
            ("micro_steps", metadata.Kind.MICRO_STEPS, micro_steps),
            ("skipped_updates", metadata.Kind.SKIPPED_UPDATES, micro_steps - updates),
            ("nonfinite_skips", metadata.Kind.NONFINITE_SKIPS, nonfinite),
        ]
        with self._get_writer().as_default():
            for name, kind, value in points:
                _write_scalar(
                    metadata.TAG_PREFIX + name,
                    tf.constant(value, tf.float32),
                    step,
                    metadata.create_summary_metadata(kind),
                )

    def flush(self):
        """Writes buffered rows and flushes the event file."""
        self.write()
        if self._writer is not None:
            self._writer.flush()


def _write_scalar(tag, value, step, summary_metadata):
    return tf.summary.write(
        tag, value, step=step, metadata=summary_metadata.SerializeToString()
    )


def _variable_name(variable, prefix):
    name = getattr(variable, "path", None) or variable.name.split(":")[0]
    return name[len(prefix):] if prefix and name.startswith(prefix) else name
