"""The "Accumulation" dashboard's summaries where the host ends windows (JAX, PyTorch).

The same series as on TensorFlow. Inside the step the observer keeps the window's micro-batch
gradient norms and, at each update, the applied gradient's norms (its
device state); after each update the host adds a row of device arrays and
its own counts (no device read). `tfaccum.dashboard_writer.DashboardWriter`
writes the rows (one device read for all of them).
"""

import numpy as np
from keras import ops

from tfaccum import dashboard_writer
from tfaccum.observing import WindowObserver
from tfaccum.dashboard_writer import DashboardWriter
from tfaccum.dashboard_writer import SERIES
from tfaccum.dashboard_writer import UpdateRows

_MEASURED = ("applied_gradient_norm", "micro_norm_mean", "micro_norm_max", "noise_scale",
             "window_loss")
# The window's micro-batch losses, each times its items and times its samples.
_LOSS_SUMS = ("loss_items", "items", "loss_samples", "samples")


class WindowSummaries(WindowObserver, DashboardWriter):
    """Records what each optimizer update applied and writes it as summaries.

    The arguments and the writing schedule are `DashboardWriter`'s: rows are
    written at epoch ends, when `capacity` rows wait, and every
    `write_interval` seconds. A backend's subclass says which process
    writes (`writes_here`) and how its rows' values reach the host
    (`host_values`).
    """

    def __init__(self, log_dir, *, scalars=False, capacity=1024, write_interval=30.0, noise=None):
        DashboardWriter.__init__(self, log_dir, scalars=scalars, capacity=capacity,
                                 write_interval=write_interval, noise=noise)
        self._rows = []  # (step, host values, device values) per update
        self._variable_names = None

    # -- inside the compiled step ------------------------------------------------

    def initial(self):
        variables = len(self.hook.model.trainable_variables)
        # Arrays of their own: the state is donated to the compiled step.
        state = {name: ops.zeros((), "float32") for name in (
            "micro_sum", "micro_max", "micro_count", "micro_mean", "micro_top", "applied",
            "window_loss", *_LOSS_SUMS)}
        return dict(state, per_variable=ops.zeros((variables,), "float32"))

    def on_micro_step(self, state, step):
        norm = ops.sqrt(step.squared_norm)
        items = ops.cast(step.items, "float32")
        samples = ops.cast(step.samples, "float32")
        return dict(micro_sum=state["micro_sum"] + norm,
                    micro_max=ops.maximum(state["micro_max"], norm),
                    micro_count=state["micro_count"] + 1.0,
                    loss_items=state["loss_items"] + step.loss * items,
                    items=state["items"] + items,
                    loss_samples=state["loss_samples"] + step.loss * samples,
                    samples=state["samples"] + samples)

    def on_apply(self, state, update):
        measured = state["micro_count"] > 0
        nan = ops.full((), float("nan"), "float32")
        per_variable = ops.sqrt(ops.stack(update.variable_squares))
        # The window's loss weighted as the large batch's: by items, or by
        # samples where the window counted none (as on TensorFlow).
        counted = state["items"] > 0
        window_loss = ops.where(
            counted, state["loss_items"] / ops.maximum(state["items"], 1.0),
            state["loss_samples"] / ops.maximum(state["samples"], 1.0))
        if update.loss is not None:  # a window-wide loss: computed once over the window
            window_loss = update.loss
        return dict(window_loss=window_loss,
                    micro_mean=ops.where(measured, state["micro_sum"]
                                         / ops.maximum(state["micro_count"], 1.0), nan),
                    micro_top=ops.where(measured, state["micro_max"], nan),
                    applied=ops.sqrt(update.squared_norm), per_variable=per_variable)

    # -- on the host ---------------------------------------------------------------

    def on_install(self, hook):
        super().on_install(hook)
        self.writes = self.writes_here()
        if self._variable_names is None:
            self._variable_names = [dashboard_writer.variable_name(v, hook.model.name)
                                    for v in hook.model.trainable_variables]

    def on_uninstall(self, hook):
        self.flush()

    def on_reset(self, state):
        return {name: ops.zeros((), "float32")
                for name in ("micro_sum", "micro_max", "micro_count", *_LOSS_SUMS)}

    def after_apply(self, iterations, window, counts):
        """Adds the row of the update just made (device values are not read yet).

        Args:
            iterations: `optimizer.iterations` after the update.
            window: The window's counts (`window_*`) and whether it was
                `applied`, host integers or device scalars.
            counts: The hook's counts after the update, likewise.
        """
        state = self.state()
        noise = ops.full((), float("nan"), "float32")
        if self.noise is not None and self.noise.state() is not None:
            noise = self.noise.current()
        device = ops.concatenate([
            ops.stack([state["applied"], state["micro_mean"], state["micro_top"], noise,
                       state["window_loss"]]),
            state["per_variable"]])  # a copy: the state is donated to the next step
        host = {"window_micro_batches": window["window_micro_batches"],
                "window_samples": window["window_samples"],
                "window_items": window["window_items"],
                "micro_steps": counts["micro_steps"],
                "skipped_updates": counts["micro_steps"] - counts["optimizer_steps"],
                "nonfinite_skips": counts["nonfinite_skips"]}
        # A window of nothing but micro-batches left out made no update: the
        # device says so, read with the rest when the rows are written.
        self._rows.append((iterations, host, device, window.get("applied", True)))

    def writes_here(self):
        """Whether this process writes the summaries (one process: it does)."""
        return True

    def host_values(self, arrays):
        """The rows' device vectors, stacked as one NumPy array (one read)."""
        return ops.convert_to_numpy(ops.stack(arrays))

    def _take_rows(self):
        rows, self._rows = self._rows, []
        if not self.writes:
            return None
        rows = [row for row in rows if bool(row[3])]
        if not rows:
            return None
        device = np.asarray(self.host_values([row[2] for row in rows]), np.float64)
        columns = {name: device[:, i] for i, name in enumerate(_MEASURED)}
        for name in SERIES:
            if name not in columns:
                columns[name] = np.asarray([row[1].get(name, np.nan) for row in rows],
                                           np.float64)
        return UpdateRows(steps=np.asarray([row[0] for row in rows]),
                          series=np.stack([columns[name] for name in SERIES], axis=1),
                          per_variable=device[:, len(_MEASURED):],
                          variable_names=self._variable_names)
