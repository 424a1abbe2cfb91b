"""An opt-in workaround for Keras 3's `fit` under `MultiWorkerMirroredStrategy`.

Keras 3's own `fit` fails across workers before any accumulation happens
(keras-team/keras#20585, tensorflow/tensorflow#72388), for two reasons in its
TensorFlow trainer (Keras 3.7-3.15):

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
patched: it refuses Keras versions it was not written for, and is to be
removed once Keras fixes those bugs.
"""

import keras

from tfaccum.backend.tensorflow import _keras_on_tf

# Keras versions whose TensorFlow trainer has the two bugs, as read.
KNOWN_VERSIONS = ((3, 7), (3, 15))


def _version(text):
    return tuple(int(part) for part in text.split(".")[:2])


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
        RuntimeError: on a Keras version this workaround does not know.
    """
    version = keras.__version__
    low, high = KNOWN_VERSIONS
    missing = _keras_on_tf.keras3_multi_worker_patch.missing()
    if not low <= _version(version) <= high or missing:
        raise RuntimeError(
            "enable_keras3_multi_worker() works around two bugs of Keras "
            f"{low[0]}.{low[1]}-{high[0]}.{high[1]}'s TensorFlow trainer "
            "(keras-team/keras#20585) and does not know this version. "
            f"Received: Keras {version}"
            + (f" (without {', '.join(missing)})" if missing else "")
            + ". Try Keras' own `fit` first (the bugs may be fixed), or use "
            "tf_keras for several workers."
        )
    _keras_on_tf.keras3_multi_worker_patch.install()


def disable_keras3_multi_worker():
    """Puts Keras' own code back (a no-op if it was not replaced)."""
    _keras_on_tf.keras3_multi_worker_patch.remove()
