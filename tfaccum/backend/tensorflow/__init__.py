"""TensorFlow's side of tfaccum (Keras 3 on TensorFlow, and tf_keras).

The step (`step`, `accumulating_step`, `gradient_cache`), its window
(`window`, `accumulators`, `counter_variable`, `gradients`, `precision`), its end
(`replication`, `sources`, `host_ends`), its installation and rollback
(`installation`, `rollback`), the observers (`observers`, with the noise scale's,
`summary`, `moments`), the toolkit's layers and losses (`layers`, `convert`,
`keras2`, `window_loss`, `loss_counting`, `multi_worker`), and the private Keras and
TensorFlow names they read (`_keras_on_tf`). `BACKEND` is what the callback asks.
"""

from tfaccum.backend import Backend
from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow import moments
from tfaccum.backend.tensorflow.hook import AccumulationHook
from tfaccum.backend.tensorflow.observers import NoiseScaleEstimator
from tfaccum.backend.tensorflow.summary import AccumulationSummaries
from tfaccum.backend.tensorflow.window_loss import window_loss_of


class TensorFlowBackend(Backend):
    """Keras 3 on TensorFlow, and tf_keras: every option tfaccum has."""

    name = "tensorflow"
    hook_class = AccumulationHook
    estimator_class = NoiseScaleEstimator
    summaries_class = AccumulationSummaries

    def writes_summaries(self, model):
        """The chief writes, or the only worker."""
        return _keras_on_tf.writes_summaries(model.distribute_strategy)

    def has_window_loss(self, model):
        return window_loss_of(model) is not None

    def layer_observer_kinds(self, model):
        return [moments.BatchNormWindows] if moments.accumulating_layers(model) else []

    def layer_observers(self, model):
        return moments.window_observers(model, model.distribute_strategy)


BACKEND = TensorFlowBackend()
