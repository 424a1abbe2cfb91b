"""Keras 3's JAX backend: the host counts the window and picks a compiled step.

`hook.py` (the hook, the same public surface as TensorFlow's), `step.py`
(the compiled functions: accumulate, normalize, apply), `window_program.py`
(a whole window as one of them, where `steps_per_execution` allows),
`devices.py` (one device, or `keras.distribution.DataParallel`'s devices,
in one process or several, each with its own partial sums),
`precision.py` (bfloat16 accumulators), `gradient_cache.py` (window-wide
losses), `batch_norm.py` (accumulation-aware batch normalization), `installation.py` (the train
function swapped in), `summary.py` (the dashboard's series) and
`_keras_on_jax.py` (what the JAX trainer is read for). `BACKEND` is what
the callback asks.
"""

from tfaccum.backend import Backend
from tfaccum.backend.jax import batch_norm
from tfaccum.backend.jax.hook import AccumulationHook
from tfaccum.backend.jax.summary import AccumulationSummaries


class JaxBackend(Backend):
    """Keras 3 on JAX."""

    name = "jax"
    hook_class = AccumulationHook
    summaries_class = AccumulationSummaries

    def writes_summaries(self, model):
        """Every process records the summaries, so that every process compiles the
        same step (its collectives must match); the first writes them
        (`AccumulationSummaries`)."""
        return True

    def layer_observer_kinds(self, model):
        return [batch_norm.BatchNormWindows] if batch_norm.accumulating_layers(model) else []

    def layer_observers(self, model):
        layers = batch_norm.accumulating_layers(model)
        return [batch_norm.BatchNormWindows(layers)] if layers else []


BACKEND = JaxBackend()
