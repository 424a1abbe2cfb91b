"""What the hook tells the things that watch its window.

The summaries, the noise-scale estimator (`NoiseScaleEstimator`, on the
estimates of `tfaccum.noise_scale`) and `AccumBatchNormalization`'s pooled
statistics all follow one protocol, `WindowObserver`; the hook calls
every observer in its list and knows none of them by name. Graph methods run
inside the compiled train step; `on_install` and `on_uninstall` run on the
host.
"""

import dataclasses
import functools

import tensorflow as tf

from tfaccum import dashboard_schema
from tfaccum import noise_scale as estimates
from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow.gradients import squared_norm


class WindowObserver:
    """Base class of what watches an accumulation window. Every method is optional.

    Graph methods (inside the compiled step):
        on_micro_step(step): a `MicroStep` was added to the window.
        on_leave_out(step): a `MicroStep` was left out (non-finite gradient).
        on_apply(update): the window was applied as an `Update`.
        on_reset(): the window was emptied (after an update, a drop, or when
            the hook is installed again).

    Host methods:
        on_install(hook): the hook was installed on its model.
        on_uninstall(hook): the hook is being removed.

    With several replicas an observer is fed by each machine's first replica
    (its micro-batches, and the window reduced over all replicas) unless it
    sets `per_replica = True`, which feeds every replica its own share.
    An observer that compares each micro-batch's own gradient with the
    window's sets `reads_micro_batch_gradients = True` (a window-wide loss
    has none).
    """

    per_replica = False
    reads_micro_batch_gradients = False

    def on_micro_step(self, step):
        pass

    def on_leave_out(self, step):
        pass

    def on_apply(self, update):
        pass

    def on_reset(self):
        pass

    def on_install(self, hook):
        pass

    def on_uninstall(self, hook):
        pass


@dataclasses.dataclass
class MicroStep:
    """One micro-batch's gradients, as the train step gave them.

    Attributes:
        grads: The gradients the step passed to the optimizer (`None` where a
            variable got none); multiplied by `gradient_scale`.
        variables: Their variables.
        samples: Samples in the micro-batch (int64; this replica's).
        items: The micro-batch's weight in its window (int64): its samples,
            or what its loss averaged over (tokens) under reduction="auto".
        gradient_scale: What `grads` are multiplied by relative to the
            micro-batch's own (mean) loss gradient: loss scaling and sample
            weighting; a float32 tensor or `None`.
        mean_divisor: What the gradient of the micro-batch's loss must be
            divided by to be a mean over its samples: its sample count under
            `reduction="sum"`, `None` otherwise.
        weighs_items: Whether the micro-batch's weight in its window is its
            `items` (a Python bool, known while tracing): then one weighed 0
            counts no item, and `items` needs no check against `measured`.
    """

    grads: list
    variables: list
    samples: tf.Tensor
    items: object = None
    gradient_scale: object = None
    mean_divisor: object = None
    weighs_items: bool = False

    @functools.cached_property
    def measured(self):
        """Whether `grads` tell the micro-batch's own gradient (a bool tensor).

        Not when they were multiplied by 0: a micro-batch that counts no item
        (every token masked) weighs nothing in a window that counts some.
        """
        if self.gradient_scale is None:
            return tf.constant(True)
        return tf.not_equal(self.gradient_scale, 0.0)

    @functools.cached_property
    def squared_norm(self):
        """Squared L2 norm of the micro-batch's own loss gradient (float32).

        Computed once per traced step, however many observers ask; 0 where
        it is not `measured`.
        """
        return _divided(squared_norm(self.grads), self.gradient_scale)

    @functools.cached_property
    def mean_squared_norm(self):
        """`squared_norm` of the gradient of the mean loss over its samples."""
        return _divided(self.squared_norm, self.mean_divisor)


@dataclasses.dataclass
class Update:
    """A window applied through the optimizer.

    Attributes:
        grads: The normalised gradients the optimizer received.
        variables: Their variables.
        gradient_scale: What `grads` are multiplied by (loss scaling), read
            before the update; a float32 tensor or `None`.
        window: `{name: int64 tensor}` of the window's counts
            (`window_micro_batches`, `window_samples`, `window_items`,
            `window_nonfinite`), over all replicas.
        counts: `{name: int64 tensor}` of this hook's counts before the
            update (`micro_steps`, `optimizer_steps`, ...).
        iterations: `optimizer.iterations` after the update.
        mean_divisor: What the applied gradient must be divided by to be the
            gradient of the mean loss over the window's samples (`reduction=
            "sum"`), or `None`.
        loss: The window's loss (float64), its micro-batches' losses weighted
            as their gradients: what the large batch's step reports.
        model_name: The model's name, left off variable paths on the dashboard.
    """

    grads: list
    variables: list
    gradient_scale: object
    window: dict
    counts: dict
    iterations: tf.Tensor
    mean_divisor: object = None
    loss: object = None
    model_name: str = ""

    @functools.cached_property
    def variable_squared_norms(self):
        """Each applied gradient's squared L2 norm as applied (`None` where none).

        Loss scaling is not undone here; `squared_norm` undoes it.
        """
        return [None if g is None else squared_norm([g]) for g in self.grads]

    @functools.cached_property
    def squared_norm(self):
        """Squared L2 norm of the applied gradient, loss scaling undone."""
        squares = [sq for sq in self.variable_squared_norms if sq is not None]
        return _divided(tf.add_n(squares), self.gradient_scale)

    @functools.cached_property
    def mean_squared_norm(self):
        """`squared_norm` of the gradient of the mean loss over the window."""
        return _divided(self.squared_norm, self.mean_divisor)


def _divided(square, scale):
    """A squared norm of gradients multiplied by `scale`, undone (`None`: as is; 0: 0)."""
    if scale is None:
        return square
    return tf.math.divide_no_nan(square, tf.square(tf.cast(scale, tf.float32)))



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
            return _keras_on_tf.local_variable(tf.zeros(shape, dtype), name)

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
        return dashboard_schema.suggested_accumulation_steps(self.noise_scale,
                                                             self.micro_batch_size)
