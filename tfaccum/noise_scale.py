"""The gradient noise scale, measured from the accumulation window.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
appendix A.1: from the squared norms of gradients at two batch sizes, a small
one (each micro-batch, B_small) and a large one (the window, B_big),

    |G|^2    ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

are unbiased, and B_simple = tr(Sigma) / |G|^2 estimates the critical batch
size. As the paper does, the two are smoothed separately (exponential moving
averages) before dividing.
"""

from tfaccum import dashboard_schema
from tfaccum.observing import WindowObserver

SMOOTHING = 0.95  # weight of the past in the moving averages (about 20 windows)


def window_estimates(window_square, big, squares, seen, batches, ops):
    """One window's unbiased estimates of |G|^2 and tr(Sigma).

    Branch-free (no nested function call in a compiled update): where the
    window held one micro-batch (B_small = B_big) `defined` is false and the
    estimates are not to be used.

    Args:
        window_square: Squared norm of the window's (normalised) gradient.
        big: Samples the window held (B_big), float32.
        squares: Sum over its micro-batches of b |g|^2 (b: a micro-batch's samples).
        seen: Sum of their b.
        batches: How many micro-batches were measured.
        ops: The backend's array namespace (`tf`, `jax.numpy`): its `where`
            and `maximum` are used.

    Returns:
        `(defined, small, gradient_square, trace)`: whether the window gives
        an estimate, B_small, |G|^2 and tr(Sigma).
    """
    seen = ops.maximum(seen, 1.0)
    small = seen / ops.maximum(batches, 1.0)
    small_square = squares / seen
    defined = big > small
    safe_gap = ops.where(defined, big - small, 1.0)
    gradient_square = (big * window_square - small * small_square) / safe_gap
    trace = (small_square - window_square) * small * big / safe_gap
    return defined, small, gradient_square, trace


def smoothed(average, value, first, ops):
    """The moving average moved by `value` (`value` itself at the first window)."""
    return ops.where(first, value, SMOOTHING * average + (1.0 - SMOOTHING) * value)


# The estimator's state, the same on every backend (arrays of the backend's
# namespace `ops`: a dict of `tf` values read from variables, or JAX arrays).
#   micro: the open window's micro-batches, [sum b |g|^2, sum b, how many];
#   gradient_square, trace: |G|^2 and tr(Sigma), smoothed;
#   micro_batch: the last B_small; windows: windows that gave an estimate.


def micro_batch_terms(square, samples, ops):
    """What one (small) batch of the window adds to `state["micro"]`: from its
    squared gradient norm and its size (float32 scalars; a size is a whole
    number, so `minimum(samples, 1)` counts the batches that held any)."""
    return ops.stack([samples * square, samples, ops.minimum(samples, 1.0)])


def add_window(state, window_square, big, ops):
    """`state` with one window's estimates added, from the micro-batches added
    since the last (which are forgotten).

    Args:
        window_square: Squared norm of the window's (normalised) gradient.
        big: Samples the window held (B_big), float32.
    """
    squares, seen, batches = state["micro"][0], state["micro"][1], state["micro"][2]
    defined, small, gradient_square, trace = window_estimates(
        window_square, big, squares, seen, batches, ops)
    first = state["windows"] == 0
    moved = {name: ops.where(defined, smoothed(state[name], value, first, ops), state[name])
             for name, value in (("gradient_square", gradient_square), ("trace", trace))}
    return dict(state, **moved, micro=ops.zeros_like(state["micro"]),
                micro_batch=ops.where(defined, small, state["micro_batch"]),
                windows=state["windows"] + ops.where(defined, 1.0, 0.0))


def current(state, ops):
    """B_simple, NaN while it is not defined."""
    defined = (state["windows"] > 0) & (state["gradient_square"] > 0)
    return ops.where(defined, state["trace"] / ops.where(defined, state["gradient_square"], 1.0),
                     float("nan"))


class NoiseScaleEstimator(WindowObserver):
    """Estimates B_simple from each window's micro-batch and window gradients.

    Within a window of B samples, its micro-batches give B_small (their mean
    size) and |G_small|^2 (the sample-weighted mean of their squared gradient
    norms; the paper's estimator when they have one size). Measuring every
    micro-batch costs one read of the gradients per micro-step; measuring only
    one per window was tried and left the estimate about 4 times noisier
    (standard deviation 0.45 instead of 0.10 of the exact value). Windows of
    one micro-batch give no estimate.

    Both norms are of the gradient of a mean loss over the samples: under
    `reduction="sum"` the micro-batch's is divided by its samples and the
    window's by the window's, which B_simple (a ratio of two squared norms)
    does not notice when the losses were means to begin with. Batch sizes are
    in the unit the window weighs by: samples, or the items (tokens) a masked
    loss averaged over.

    With several devices (data parallelism, the setting the paper designed
    the estimator for) the small batches are the first device's shares of
    the micro-batches (on JAX, every device's), and the big one the window
    summed over all of them.

    Example:

    ```python
    callback = tfaccum.GradientAccumulationCallback(accumulation_steps=8, noise_scale=True)
    model.fit(x, y, batch_size=16, callbacks=[callback])
    callback.noise_scale, callback.suggested_accumulation_steps
    ```
    """

    reads_micro_batch_gradients = True

    def __repr__(self):
        return f"NoiseScaleEstimator(noise_scale={self.noise_scale!r})"

    def initial(self):
        ops = self.hook.ops
        return {"micro": ops.zeros((3,), "float32"), "gradient_square": ops.zeros((), "float32"),
                "trace": ops.zeros((), "float32"), "micro_batch": ops.zeros((), "float32"),
                "windows": ops.zeros((), "float32")}

    def on_micro_step(self, state, step):
        ops = self.hook.ops  # a micro-batch weighted by 0 says nothing: no measured items
        return {"micro": state["micro"] + micro_batch_terms(
            step.mean_squared_norm, _float32(step.measured_items, ops), ops)}

    def on_apply(self, state, update):
        ops = self.hook.ops
        return add_window(state, update.mean_squared_norm,
                          _float32(update.window["window_items"], ops), ops)

    def on_reset(self, state):
        return {"micro": self.hook.ops.zeros((3,), "float32")}

    def restart(self):
        """Forgets every estimate (a new `fit` of a new callback)."""
        if self.hook is not None:
            self.hook.set_observer_state(self, self.initial())

    def current(self):
        """B_simple now as a backend scalar, NaN while it is not defined (no host read)."""
        return current(self.state(), self.hook.ops)

    @property
    def noise_scale(self):
        """B_simple, or `None` until a window with two micro-batches gave one."""
        if self.state() is None:
            return None
        value = float(self.current())
        return None if value != value else value  # NaN: not defined yet

    @property
    def micro_batch_size(self):
        state = self.state()
        return None if state is None else (float(state["micro_batch"]) or None)

    def suggested_accumulation_steps(self):
        """`accumulation_steps` whose effective batch is closest to B_simple.

        The dashboard's rule (`tfaccum.dashboard_schema`), so both say the same.
        """
        return dashboard_schema.suggested_accumulation_steps(self.noise_scale,
                                                             self.micro_batch_size)


def _float32(value, ops):
    """`value` as float32 in the namespace `ops` (`tf.cast`, `jax.numpy.asarray`)."""
    return ops.cast(value, "float32") if hasattr(ops, "cast") else ops.asarray(value, "float32")
