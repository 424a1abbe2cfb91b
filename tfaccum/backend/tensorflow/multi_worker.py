"""An opt-in workaround for Keras 3's `fit` under `MultiWorkerMirroredStrategy`.

Keras 3's own `fit` fails across workers before any accumulation happens
(keras-team/keras#20585, tensorflow/tensorflow#72388), for two reasons in its
TensorFlow trainer (Keras 3.7-3.16, read in each):

1. `_maybe_symbolic_build` hands a nested structure of `PerReplica` batches to
   `strategy.reduce`, which cannot take one across workers ("Attempt to
   convert a value (PerReplica...)"). The build only needs shapes: the first
   local replica's batch gives them.
2. The per-step logs are reduced with `strategy.reduce("MEAN", v, axis=0)`
   although each is a scalar. They are reduced with `axis=None` (the mean
   over replicas, what one worker's `fit` reports).

`enable_keras3_multi_worker()` replaces those two, only where several
workers are involved (one machine's strategies keep Keras' code), and
`disable_keras3_multi_worker()` puts Keras' back. Private Keras code is
patched: it refuses a Keras that lacks what it replaces, and is to be
removed once Keras fixes those bugs.
"""

import keras

from tfaccum.backend.tensorflow import _keras_on_tf

def enable_keras3_multi_worker():
    """Makes Keras 3's `fit` work under `MultiWorkerMirroredStrategy` (opt-in).

    Call it once per worker process, before `fit`. Idempotent. Everything
    else (one device, `MirroredStrategy`) runs Keras' code unchanged.

    Example:

    ```python
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    tfaccum.enable_keras3_multi_worker()
    with strategy.scope():
        model = build_and_compile()
    model.fit(x, y, batch_size=64,
              callbacks=[tfaccum.GradientAccumulationCallback(accumulation_steps=4)])
    ```

    Raises:
        RuntimeError: on a Keras that lacks the functions it replaces.
    """
    missing = _keras_on_tf.keras3_multi_worker_patch.missing()
    if missing:
        raise RuntimeError(
            "enable_keras3_multi_worker() works around two bugs of Keras 3's TensorFlow "
            "trainer (keras-team/keras#20585, read in Keras 3.7-3.16), but this Keras "
            f"lacks what it replaces: {', '.join(missing)}. Received: Keras "
            f"{keras.__version__}. Try Keras' own `fit` first (the bugs may be fixed), or "
            "use tf_keras for several workers."
        )
    _keras_on_tf.keras3_multi_worker_patch.install()


def disable_keras3_multi_worker():
    """Puts Keras' own code back (a no-op if it was not replaced)."""
    _keras_on_tf.keras3_multi_worker_patch.remove()
