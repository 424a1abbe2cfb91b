"""TensorFlow's side of tfaccum (Keras 3 on TensorFlow, and tf_keras).

The core: the step (`step`, `accumulating_step`), its window (`window`,
`accumulators`, `counter_variable`, `gradients`), its end (`devices`,
`sources`, `host_ends`), its installation and rollback (`installation`,
`rollback`), the observers' states (`observer_states`), the dashboard's rows (`summary`)
and the private Keras and TensorFlow names they read (`_keras_on_tf`).
The features it composes, each apart: `batch_norm/` (accumulation-aware
batch normalization), `window_loss/` (window-wide losses by gradient
caching), `loss_counting` (what each output's loss averaged over),
`precision` (bfloat16 accumulators) and `multi_worker` (Keras 3's `fit`
across workers). `BACKEND` is what the callback asks.
"""

from tfaccum.backend import Backend
from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow.batch_norm import moments
from tfaccum.backend.tensorflow.hook import AccumulationHook
from tfaccum.backend.tensorflow.summary import AccumulationSummaries


class TensorFlowBackend(Backend):
    """Keras 3 on TensorFlow, and tf_keras: every option tfaccum has."""

    name = "tensorflow"
    hook_class = AccumulationHook
    summaries_class = AccumulationSummaries

    def writes_summaries(self, model):
        """The chief writes, or the only worker."""
        return _keras_on_tf.writes_summaries(model.distribute_strategy)

    def layer_observer_kinds(self, model):
        return [moments.BatchNormWindows] if moments.accumulating_layers(model) else []

    def layer_observers(self, model):
        return moments.window_observers(model, model.distribute_strategy)


BACKEND = TensorFlowBackend()
