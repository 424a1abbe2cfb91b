"""Gradient norms, computed in the train step."""

import tensorflow as tf


def squared_norm(grads):
    """Squared global L2 norm of `grads` (`None` entries skipped), float32."""
    total = []
    for grad in grads:
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            # Sum repeated rows first: the norm of the dense gradient.
            unique, positions = tf.unique(grad.indices)
            grad = tf.math.unsorted_segment_sum(
                grad.values, positions, tf.shape(unique)[0]
            )
        if grad.dtype != tf.float32:
            grad = tf.cast(grad, tf.float32)
        # `l2_loss` (sum of squares / 2) reads the gradient once in one op:
        # the cheapest of five ways measured on the CPU (this runs every
        # micro-step; benchmarks/throughput.py measures what it costs).
        total.append(tf.nn.l2_loss(grad))
    if not total:  # no gradient at all (a loss that does not reach the weights)
        return tf.constant(0.0)
    return 2.0 * tf.add_n(total)


def unscaled(value, scale):
    """`value / scale`, or `value` when `scale` is None."""
    return value if scale is None else value / scale
