"""The gradient noise scale on TensorFlow: the estimator as a window observer.

The estimates themselves are `tfaccum.noise_scale`'s (McCandlish et al. 2018).
"""

import tensorflow as tf

from tfaccum import dashboard_schema
from tfaccum.backend.tensorflow import _keras
from tfaccum.backend.tensorflow.observers import WindowObserver
from tfaccum import noise_scale as estimates


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
    does not notice when the losses were means to begin with.

    With several replicas (data parallelism, the setting the paper designed
    the estimator for) the small batches are the first replica's shares of
    the micro-batches, and the big one the window summed over all replicas:
    nothing crosses devices for it (its variables are this machine's).
    """

    reads_micro_batch_gradients = True

    def __init__(self):
        def variable(name, dtype=tf.float32, shape=()):
            return _keras.local_variable(tf.zeros(shape, dtype), name)

        # The window's micro-batches so far, one variable (one update per
        # micro-step): sum b |g|^2, sum b, and how many were measured.
        self._micro = variable("micro_batch_sums", shape=(3,))
        self._gradient_square = variable("gradient_square_ema")  # |G|^2
        self._trace = variable("trace_sigma_ema")  # tr(Sigma)
        self._micro_batch = variable("micro_batch_size")  # last B_small
        self._windows = variable("noise_scale_windows")  # a float32 count

    def _state(self):
        """`tfaccum.noise_scale`'s state, read from the variables."""
        return {"micro": self._micro.read_value(),
                "gradient_square": self._gradient_square.read_value(),
                "trace": self._trace.read_value(), "micro_batch": self._micro_batch.read_value(),
                "windows": self._windows.read_value()}

    def _keep(self, state):
        for variable, name in ((self._micro, "micro"), (self._gradient_square, "gradient_square"),
                               (self._trace, "trace"), (self._micro_batch, "micro_batch"),
                               (self._windows, "windows")):
            variable.assign(state[name])

    def __repr__(self):
        return f"NoiseScaleEstimator(noise_scale={self.noise_scale!r})"

    # -- the window protocol ----------------------------------------------------

    # Batch sizes are in the unit the window weights by: samples, or under
    # reduction="auto" with masked losses the items (tokens) averaged over.
    def on_micro_step(self, step):
        items = step.samples if step.items is None else step.items
        if not step.weighs_items:
            # A micro-batch weighted by 0 says nothing (where it weighs its
            # items, it counted none: nothing to select).
            items = tf.where(step.measured, items, tf.zeros_like(items))
        self.add_micro_batch(step.mean_squared_norm, items)

    def on_apply(self, update):
        self.add_window(update.mean_squared_norm, samples=update.window["window_items"])

    def on_reset(self):
        self._micro.assign(tf.zeros((3,)))

    def restart(self):
        """Forgets every estimate (a new `fit` of a new callback)."""
        for variable in (self._gradient_square, self._trace, self._micro_batch, self._windows):
            variable.assign(tf.zeros_like(variable))
        self.on_reset()

    # -- the estimators ----------------------------------------------------------

    def add_micro_batch(self, square, samples):
        """Adds a (small) batch of the window: its squared gradient norm and size."""
        self._micro.assign_add(estimates.micro_batch_terms(
            square, tf.cast(samples, tf.float32), tf))

    def add_window(self, window_square, samples):
        """Adds one window's estimates, from the batches added since the last.

        Args:
            window_square: Squared norm of the window's (normalised) gradient.
            samples: Samples the window held (B_big), int64.
        """
        self._keep(estimates.add_window(self._state(), window_square,
                                        tf.cast(samples, tf.float32), tf))

    def current(self):
        """B_simple now as a float32 tensor, NaN while it is not defined."""
        return estimates.current(self._state(), tf)

    # -- on the host ----------------------------------------------------------

    @property
    def noise_scale(self):
        """B_simple, or `None` until a window with two micro-batches gave one."""
        value = float(self.current().numpy())
        return None if value != value else value  # NaN: not defined yet

    @property
    def micro_batch_size(self):
        return float(self._micro_batch.numpy()) or None

    def suggested_accumulation_steps(self):
        """`accumulation_steps` whose effective batch is closest to B_simple.

        The dashboard's rule (`tfaccum.dashboard_schema`), so both say the same.
        """
        return dashboard_schema.suggested_accumulation_steps(self.noise_scale, self.micro_batch_size)
