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
import tensorflow as tf

# Keras versions whose TensorFlow trainer has the two bugs, as read.
KNOWN_VERSIONS = ((3, 7), (3, 15))

_originals = {}


def _version(text):
    return tuple(int(part) for part in text.split(".")[:2])


def _trainer_module():
    from keras.src.backend.tensorflow import trainer

    return trainer


def _across_workers(module, strategy):
    # Private: Keras' own test for this case (3.7-3.15).
    return module._collective_all_reduce_multi_worker(strategy)


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
    module = _trainer_module()
    missing = [
        name
        for name, owner in (
            ("reduce_per_replica", module),
            ("_collective_all_reduce_multi_worker", module),
            ("_maybe_symbolic_build", getattr(module, "TensorFlowTrainer", None)),
        )
        if not hasattr(owner, name)
    ]
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
    if _originals:
        return
    trainer = module.TensorFlowTrainer
    reduce_per_replica = module.reduce_per_replica
    maybe_symbolic_build = trainer._maybe_symbolic_build

    def reduce_logs(values, strategy, reduction):
        if reduction in ("auto", "mean") and _across_workers(module, strategy):
            return tf.nest.map_structure(
                lambda v: (
                    strategy.reduce("MEAN", v, axis=None)
                    if isinstance(v, tf.distribute.DistributedValues)
                    else v
                ),
                values,
            )
        return reduce_per_replica(values, strategy, reduction)

    def symbolic_build(model, iterator=None, data_batch=None):
        strategy = model._distribute_strategy
        if iterator is None or strategy is None or not _across_workers(module, strategy):
            return maybe_symbolic_build(model, iterator=iterator, data_batch=data_batch)
        for step in iterator:  # (step, iterator), or (begin, end, iterator) from 3.10
            data_batch = tf.nest.map_structure(
                lambda v: (
                    strategy.experimental_local_results(v)[0]
                    if isinstance(v, tf.distribute.DistributedValues)
                    else v
                ),
                next(step[-1]),
            )
            break
        with strategy.scope():
            model._symbolic_build(data_batch=data_batch)

    _originals.update(reduce=reduce_per_replica, build=maybe_symbolic_build)
    module.reduce_per_replica = reduce_logs
    trainer._maybe_symbolic_build = symbolic_build


def disable_keras3_multi_worker():
    """Puts Keras' own code back (a no-op if it was not replaced)."""
    if not _originals:
        return
    module = _trainer_module()
    module.reduce_per_replica = _originals["reduce"]
    module.TensorFlowTrainer._maybe_symbolic_build = _originals["build"]
    _originals.clear()
