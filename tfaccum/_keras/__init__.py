"""The one place that knows which Keras a model belongs to, and Keras' private parts.

The package re-exports, for `_keras.name`, what its modules hold: `api`
(`api_for(model)`: which Keras, and whether its backend is served), `keras3`
(the `Keras3` object: every way Keras 3 differs from tf_keras, as methods),
`models` (what both read alike of a model, its optimizers and its `fit`).
None of them imports TensorFlow: what only TensorFlow's side reads (Keras 3's
optimizer methods, losses and seeds in `Keras3OnTf`, tf_keras' `TfKeras`,
gradient caching's view of the step, distribution, batch normalization,
multi-worker) is in `tfaccum.backend.tensorflow._keras_on_tf`, which
re-exports this package too.

tfaccum serves Keras 3 (`keras`, `tf.keras` in TensorFlow 2.16+) and Keras 2
(`tf_keras`, or `tf.keras` with `TF_USE_LEGACY_KERAS=1`) from one
implementation: whoever needs a difference asks `api_for(model)`; no function
asks the version itself. `tf_keras` is never imported here; a model can
only be a `tf_keras` model once its user has imported it.

Every private Keras or TensorFlow attribute tfaccum uses is read or written
here or in a backend's `_keras` package, and nowhere else; each says which versions it was checked on. "Checked"
means read in the sources and exercised by the test suite, which CI runs on
the newest pair (TensorFlow 2.21, Keras 3.15.1, tf_keras 2.21), on Keras'
next pre-release (`make test-next`, `private.NEWEST_TESTED`) and, as a
smoke subset, on the oldest supported one (TensorFlow 2.16.2, Keras 3.7.0,
tf_keras 2.16.0). `private` decides once, at import, by what the installed
Keras has, where versions differ, and makes a missing name an error at the
first `fit` (`KerasNotServedError`).
"""

from tfaccum._keras.api import (  # noqa: F401
    api_for,
    api_for_model_argument,
    check_backend,
    SUPPORTED_BACKENDS,
)
from tfaccum._keras.models import (  # noqa: F401
    Callback,
    build_compiled_metrics,
    compiled_with_optimizer,
    fit_arguments,
    fit_callback_list,
    fit_is_running,
    flatten_layers,
    is_model,
    is_tf_keras_model,
    iterations,
    metrics_given,
    optimizer_variables,
    orbax_checkpoint_class,
    print_msg,
    resume_at_epoch,
    regularized_variables,
    scales_loss_dynamically,
    unpack_x_y_sample_weight,
    variable_numpy,
)
from tfaccum._keras.keras3 import (  # noqa: F401
    Keras3,
)

__all__ = [
    "api_for",
    "api_for_model_argument",
    "check_backend",
    "SUPPORTED_BACKENDS",
    "Callback",
    "build_compiled_metrics",
    "compiled_with_optimizer",
    "fit_arguments",
    "fit_callback_list",
    "fit_is_running",
    "flatten_layers",
    "is_model",
    "is_tf_keras_model",
    "iterations",
    "metrics_given",
    "optimizer_variables",
    "orbax_checkpoint_class",
    "print_msg",
    "resume_at_epoch",
    "regularized_variables",
    "scales_loss_dynamically",
    "unpack_x_y_sample_weight",
    "variable_numpy",
    "Keras3",
]
