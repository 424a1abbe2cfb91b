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
        # As a [1, n] x [n, 1] product: BLAS reads the gradient once, faster
        # on CPUs than TensorFlow's reductions (this runs every micro-step).
        row = tf.reshape(tf.cast(grad, tf.float32), (1, -1))
        total.append(tf.matmul(row, row, transpose_b=True)[0, 0])
    return tf.add_n(total)


def unscaled(value, scale):
    """`value / scale`, or `value` when `scale` is None."""
    return value if scale is None else value / scale
