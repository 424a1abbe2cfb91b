"""TensorFlow's side of tfaccum (Keras 3 on TensorFlow, and tf_keras).

The step (`step`, `accumulating_step`, `gradient_cache`), its window
(`window`, `accumulators`, `counts`, `gradients`, `precision`), its end
(`replication`, `sources`, `host_ends`), its installation and rollback
(`installation`, `rollback`), the observers (`observers`, `noise_scale`,
`summary`, `moments`), the toolkit's layers and losses (`layers`, `convert`,
`keras2`, `window_loss`, `items`, `multi_worker`), and the private Keras and
TensorFlow names they read (`_keras`).

The names below are what the callback asks of a backend.
"""

from tfaccum.backend.tensorflow import _keras
from tfaccum.backend.tensorflow.hook import AccumulationHook  # noqa: F401
from tfaccum.backend.tensorflow.moments import accumulating_layers  # noqa: F401
from tfaccum.backend.tensorflow.moments import BatchNormWindows  # noqa: F401
from tfaccum.backend.tensorflow.noise_scale import NoiseScaleEstimator  # noqa: F401
from tfaccum.backend.tensorflow.summary import AccumulationSummaries  # noqa: F401
from tfaccum.dashboard_writer import probe_log_dir  # noqa: F401
from tfaccum.backend.tensorflow.window_loss import window_loss_of  # noqa: F401

NAME = "tensorflow"


def writes_summaries(model):
    """Whether this worker writes `model`'s summaries: the chief, or the only one."""
    return _keras.writes_summaries(model.distribute_strategy)


def window_observers(model):
    """The observers `model`'s layers need (`BatchNormWindows`), as a list."""
    from tfaccum.backend.tensorflow.moments import window_observers as made_for

    return made_for(model, model.distribute_strategy)
