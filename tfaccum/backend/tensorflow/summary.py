"""Accumulation summaries for TensorBoard's "Accumulation" dashboard, on TensorFlow.

The per-update figures are computed inside the model's compiled train step and
kept in a small buffer of device variables (no host round trip per
micro-step, and nothing XLA cannot compile); a write reads the buffered rows
once and `tfaccum.dashboard_writer.DashboardWriter` writes them, at epoch
ends, before the buffer can fill and every `write_interval` seconds.
"""

import warnings

import numpy as np
import tensorflow as tf

from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow.gradients import unscaled
from tfaccum.observing import WindowObserver
from tfaccum import dashboard_writer
from tfaccum.dashboard_writer import DashboardWriter
from tfaccum.dashboard_writer import SERIES
from tfaccum.dashboard_writer import UpdateRows

# Columns of a buffered row: the step, then `SERIES`.
_COLUMNS = ("step",) + SERIES


class AccumulationSummaries(WindowObserver, DashboardWriter):
    """Records what each optimizer update applied and writes it as summaries.

    Rows are written when the hook is removed, at every epoch end (by the
    callback), before the device buffer of `capacity` rows can fill, and
    when `write_interval` seconds have passed since the last write, so that
    a killed process loses at most that much. The arguments are
    `DashboardWriter`'s.
    """

    def __init__(self, log_dir, *, scalars=False, capacity=1024, write_interval=30.0, noise=None):
        DashboardWriter.__init__(self, log_dir, scalars=scalars, capacity=capacity,
                                 write_interval=write_interval, noise=noise)
        self._variable_names = None  # fixed when the train step is traced
        self._columns = None  # of `_norms`: a column per trainable variable
        # One row more than `capacity`: where an update that finds the
        # buffer full goes (never written out), so that storing a row
        # needs no branch.
        self._rows = _keras_on_tf.local_variable(
            tf.zeros((capacity + 1, len(_COLUMNS)), tf.float64), "summary_rows"
        )
        self._row_count = _keras_on_tf.local_variable(tf.zeros((), tf.int64), "summary_row_count")
        # Updates that found the buffer full (none when written in time).
        self._overflow = _keras_on_tf.local_variable(tf.zeros((), tf.int64), "summary_overflow")
        self._norms = None  # (capacity, variables), created at installation

    # -- the window protocol (inside the train step) ------------------------------

    def initial(self):
        # Sum and maximum of the micro-batch gradient norms in the window.
        return {name: tf.zeros((), tf.float32)
                for name in ("micro_norm_sum", "micro_norm_max", "micro_count")}

    def on_micro_step(self, state, step):
        """Adds one micro-batch's gradient norm (few ops: every micro-step)."""
        norm = tf.sqrt(step.squared_norm)  # 0 where not measured
        return {"micro_norm_sum": state["micro_norm_sum"] + norm,
                "micro_norm_max": tf.maximum(state["micro_norm_max"], norm),
                "micro_count": state["micro_count"] + tf.cast(step.measured, tf.float32)}

    def on_install(self, hook):
        super().on_install(hook)
        # Sized by the model's variables, on the host; a model not built
        # yet gets it at the first trace.
        if self._norms is None and hook.model.trainable_variables:
            self._make_norms(hook.model.trainable_variables)

    def _make_norms(self, variables):
        self._columns = {id(v): i for i, v in enumerate(variables)}
        self._norms = _keras_on_tf.local_variable(
            tf.zeros((self.capacity + 1, len(variables)), tf.float32),
            "summary_accumulator_norms",
        )

    def on_apply(self, state, update):
        """Buffers one row for an optimizer update (an `Update`)."""
        present = [v for sq, v in zip(update.variable_squares, update.variables) if sq is not None]
        if self._norms is None:
            self._make_norms(present)
        if self._variable_names is None:
            self._variable_names = [
                (dashboard_writer.variable_name(v, self.hook.model.name), self._columns[id(v)])
                for v in present
            ]
        squares = [sq for sq in update.variable_squares if sq is not None]
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
        measured = state["micro_count"] > 0
        values = {
            "applied_gradient_norm": tf.norm(present_norms),
            # Not a number where no micro-batch gradient was measured (a
            # window-wide loss has none of its own).
            "micro_norm_mean": tf.where(
                measured, tf.cast(state["micro_norm_sum"], tf.float64)
                / tf.cast(tf.maximum(state["micro_count"], 1.0), tf.float64),
                tf.constant(float("nan"), tf.float64)),
            "micro_norm_max": tf.where(measured, state["micro_norm_max"], float("nan")),
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
                       + [tf.cast(values[name], tf.float64) for name in SERIES])
        # A full buffer sends the row to the spare row: never overwrite a
        # stored one; count what was lost, the host warns.
        count = self._row_count.read_value()
        index = tf.minimum(count, self.capacity)
        self._rows.scatter_nd_update([[index]], [row])
        self._norms.scatter_nd_update([[index]], [norms])
        self._row_count.assign(tf.minimum(count + 1, self.capacity))
        self._overflow.assign_add(tf.cast(count >= self.capacity, tf.int64))
        return {}

    def on_reset(self, state):
        return self.initial()

    def on_uninstall(self, hook):
        self.flush()

    # -- on the host ---------------------------------------------------------------

    def _take_rows(self):
        """The buffered rows (one read), the buffer emptied; warns of rows lost."""
        rows = None
        count = 0 if self._norms is None else int(self._row_count.numpy())
        if count:
            buffered = self._rows.numpy()[:count]
            rows = UpdateRows(
                steps=buffered[:, 0].astype(np.int64), series=buffered[:, 1:],
                per_variable=self._norms.numpy()[:count][
                    :, [column for _, column in self._variable_names]],
                variable_names=[name for name, _ in self._variable_names])
            self._row_count.assign(0)
        lost = 0 if self._norms is None else int(self._overflow.numpy())
        if lost:
            self._overflow.assign(0)
            self.lost_rows += lost
            warnings.warn(
                f"{lost} optimizer updates' summaries found the device buffer "
                f"of {self.capacity} rows full and were not recorded in "
                f"{self.log_dir!r}. Write them more often: call "
                "`summaries.write()` (or train with GradientAccumulationCallback, "
                "which writes in time).",
                stacklevel=3,
            )
        return rows
