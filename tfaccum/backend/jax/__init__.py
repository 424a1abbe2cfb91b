"""Keras 3's JAX backend: the host counts the window and picks a compiled step.

`hook.py` (the hook, the same public surface as TensorFlow's), `step.py`
(the compiled functions: accumulate, normalize, apply), `parallel.py` (one
device, or `keras.distribution.DataParallel`'s devices, each with its own
partial sums), `installation.py` (the train function swapped in),
`observers.py` (the noise scale's estimator), `summary.py` (the dashboard's
series) and `_keras.py` (what the JAX trainer is read for). The names below
are what the callback asks of a backend; an observer the backend does not
make yet is `None` (the callback then refuses the option that asks for it,
by name).
"""

from tfaccum.backend.jax.hook import AccumulationHook  # noqa: F401
from tfaccum.backend.jax.observers import NoiseScaleEstimator  # noqa: F401
from tfaccum.backend.jax.summary import AccumulationSummaries  # noqa: F401
from tfaccum.dashboard_writer import probe_log_dir  # noqa: F401

NAME = "jax"
BatchNormWindows = None


def writes_summaries(model):
    """Whether this process writes `model`'s summaries: the first one does."""
    import jax

    return jax.process_index() == 0


def window_loss_of(model):
    """Window-wide losses are TensorFlow's only, for now: `None`."""
    return None


def accumulating_layers(model):
    """`AccumBatchNormalization` layers are TensorFlow's only, for now: none."""
    return []


def window_observers(model):
    return []
