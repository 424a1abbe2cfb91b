"""Keras 3's TensorFlow trainer across several workers (see `tfaccum.backend.tensorflow.multi_worker`)."""

import tensorflow as tf

from tfaccum._keras import models


class _Keras3MultiWorkerPatch:
    """Replaces two functions of Keras 3's TensorFlow trainer across workers.

    See `tfaccum.backend.tensorflow.multi_worker`. Private: `keras.src.backend.tensorflow.trainer`'s
    `reduce_per_replica`, `_collective_all_reduce_multi_worker` and its
    trainer class's `_maybe_symbolic_build` (`Trainer` from 3.16,
    `TensorFlowTrainer` in 3.7-3.15), and `Model._distribute_strategy`
    (Keras 3.7-3.16), replaced process-wide while
    installed (only where several workers are involved do they act).
    """

    def __init__(self):
        self._originals = {}

    @staticmethod
    def trainer_module():
        from keras.src.backend.tensorflow import trainer

        return trainer

    def _trainer(self):
        """The trainer class: `Trainer` from 3.16, `TensorFlowTrainer` in 3.7-3.15."""
        module = self.trainer_module()
        return getattr(module, "Trainer", None) or getattr(module, "TensorFlowTrainer", None)

    def missing(self):
        """The private names this Keras lacks (empty when the patch fits)."""
        module = self.trainer_module()
        return [
            name
            for name, owner in (
                ("reduce_per_replica", module),
                ("_collective_all_reduce_multi_worker", module),
                ("_maybe_symbolic_build", self._trainer()),
            )
            if not hasattr(owner, name)
        ]

    def install(self):
        if self._originals:
            return
        module = self.trainer_module()
        trainer = self._trainer()
        reduce_per_replica = module.reduce_per_replica
        maybe_symbolic_build = trainer._maybe_symbolic_build

        def across_workers(strategy):
            return module._collective_all_reduce_multi_worker(strategy)

        def reduce_logs(values, strategy, reduction):
            if reduction in ("auto", "mean") and across_workers(strategy):
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
            if iterator is None or strategy is None or not across_workers(strategy):
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
                models.build_compiled_metrics(model, data_batch)

        self._originals.update(reduce=reduce_per_replica, build=maybe_symbolic_build)
        module.reduce_per_replica = reduce_logs
        trainer._maybe_symbolic_build = symbolic_build

    def remove(self):
        if not self._originals:
            return
        module = self.trainer_module()
        module.reduce_per_replica = self._originals["reduce"]
        self._trainer()._maybe_symbolic_build = self._originals["build"]
        self._originals.clear()


keras3_multi_worker_patch = _Keras3MultiWorkerPatch()
