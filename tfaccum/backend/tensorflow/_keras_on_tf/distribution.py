"""`tf.distribute` and graph internals: replicas, all-reduces, the window's branch."""

import tensorflow as tf


def local_variable(initial_value, name):
    """A non-trainable variable of this machine only, even inside a strategy's scope.

    Observers keep what they see in such variables: with several replicas
    nothing of theirs is mirrored, broadcast or reduced, so a callback given
    to one worker only starts no collective. Private: a `ResourceVariable`
    built directly skips the strategy's variable creator (TensorFlow
    2.16-2.21; `tf.Variable` would make a mirrored one).
    """
    from tensorflow.python.ops import resource_variable_ops

    with tf.init_scope():
        return resource_variable_ops.ResourceVariable(initial_value, trainable=False, name=name)


def under_strategy(strategy):
    """Whether `strategy` is not TensorFlow's default one: its step then runs in
    a replica context, where Keras' update calls `merge_call`, even on one
    replica (`MirroredStrategy` on one GPU). Private: the default strategy's
    singleton, `distribute_lib._get_default_strategy()` (TensorFlow 2.16-2.21).
    """
    from tensorflow.python.distribute import distribute_lib

    return strategy is not distribute_lib._get_default_strategy()


def for_each_replica(strategy, fn, args=(), kwargs=None):
    """Runs `fn` on every replica, from the cross-replica context of a step.

    Private in TensorFlow 2: `StrategyExtendedV1.call_for_each_replica`,
    which `MirroredStrategy` and `MultiWorkerMirroredStrategy`'s extended
    objects keep (TensorFlow 2.16-2.21); `strategy.run` cannot be called
    inside a `merge_call`.
    """
    return strategy.extended.call_for_each_replica(fn, args=args, kwargs=kwargs)


def writes_summaries(strategy):
    """Whether this worker writes summaries: the chief, or the only one.

    Private in TensorFlow 2: `StrategyExtendedV1.should_save_summary`
    (TensorFlow 2.16-2.21), what Keras' own TensorBoard callback reads.
    """
    return getattr(strategy.extended, "should_save_summary", True)


def all_reduce_sum(grads):
    """`grads` summed over replicas (one batched all-reduce; `None` kept)."""
    present = [g for g in grads if g is not None]
    if not present:
        return list(grads)
    reduced = iter(
        tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, present)
    )
    return [None if g is None else next(reduced) for g in grads]


def keep_as_function_call(cond_output):
    """Asks TensorFlow not to inline the update branch into the step's graph.

    Inlined (TensorFlow's default), every op of the optimizer update is
    visited on every micro-step, as a dead branch, though it runs once per
    window; kept as a function call, a micro-step skips it in one op. XLA
    compiles `If` itself and needs nothing.

    Private: the op attribute `_lower_using_switch_merge`, set through
    `Operation._set_attr` (TensorFlow 2.16-2.21; `tf.cond` sets the same
    attribute for its own lowering choice). If TensorFlow changes it, the
    default (correct, slightly slower) is kept.
    """
    if tf.executing_eagerly():
        return
    try:
        from tensorflow.core.framework import attr_value_pb2

        op = cond_output.op
        while op.type not in ("If", "StatelessIf"):
            op = op.inputs[0].op
        op._set_attr("_lower_using_switch_merge", attr_value_pb2.AttrValue(b=False))
    except Exception:  # noqa: BLE001 - a missed speed-up, nothing worse
        pass
