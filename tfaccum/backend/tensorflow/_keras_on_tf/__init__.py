"""Keras' and TensorFlow's private parts that only the TensorFlow backend needs.

`_keras.name` here is everything `tfaccum._keras` holds and, beside it,
`api_for(model)` (this backend's: `keras3_on_tf.Keras3OnTf`, the core's
`Keras3` with what only this backend reads of it, or `tf_keras.TfKeras`: every
way tf_keras differs from Keras 3),
`model_parts` (its step, embedding tables, every variable training may change,
other optimizers), `cached_step` (gradient caching's view of the step),
`losses` (compiled losses, masks and their divisors), `distribution`
(`tf.distribute` replicas), `batch_norm` and `multi_worker`. The same rule
holds as in `tfaccum._keras`: each private name read says which versions it
was checked on.
"""

from tfaccum._keras import *  # noqa: F401,F403
from tfaccum._keras import __all__ as _common

from tfaccum.backend.tensorflow._keras_on_tf.keras3_on_tf import (  # noqa: F401
    api_for,
    Keras3OnTf,
)
from tfaccum.backend.tensorflow._keras_on_tf.tf_keras import (  # noqa: F401
    TfKeras,
)
from tfaccum.backend.tensorflow._keras_on_tf.model_parts import (  # noqa: F401
    compile_config,
    embedding_tables,
    forget_traced_functions,
    other_optimizers,
    stateful_variables,
    trains_with_keras_step,
)
from tfaccum._keras.models import (  # noqa: F401
    compiled_losses_of,
    computes_loss_as_keras,
    wrapped_losses_patch,
)
from tfaccum.backend.tensorflow._keras_on_tf.cached_step import (  # noqa: F401
    metrics_result,
    scaled_loss,
    training_forward,
)
from tfaccum.backend.tensorflow._keras_on_tf.losses import (  # noqa: F401
    as_in_total_loss,
    keras_mask,
    loss_divisor,
    may_hold_several_losses,
)
from tfaccum.backend.tensorflow._keras_on_tf.distribution import (  # noqa: F401
    all_reduce_sum,
    for_each_replica,
    keep_as_function_call,
    local_variable,
    under_strategy,
    writes_summaries,
)
from tfaccum.backend.tensorflow._keras_on_tf.batch_norm import (  # noqa: F401
    batch_norm_moments,
    batch_norm_reduction_axes,
    batch_norm_renorm,
    tf_keras_batch_norm_moments,
    tf_keras_training_value,
)
from tfaccum.backend.tensorflow._keras_on_tf.multi_worker import (  # noqa: F401
    keras3_multi_worker_patch,
)
__all__ = _common + [
    "Keras3OnTf",
    "TfKeras",
    "compile_config",
    "embedding_tables",
    "forget_traced_functions",
    "other_optimizers",
    "stateful_variables",
    "trains_with_keras_step",
    "computes_loss_as_keras",
    "metrics_result",
    "scaled_loss",
    "training_forward",
    "as_in_total_loss",
    "compiled_losses_of",
    "keras_mask",
    "loss_divisor",
    "may_hold_several_losses",
    "wrapped_losses_patch",
    "all_reduce_sum",
    "under_strategy",
    "for_each_replica",
    "keep_as_function_call",
    "local_variable",
    "writes_summaries",
    "batch_norm_moments",
    "batch_norm_reduction_axes",
    "batch_norm_renorm",
    "tf_keras_batch_norm_moments",
    "tf_keras_training_value",
    "keras3_multi_worker_patch",
]
