"""Gradients as the train step hands them: dense tensors, `IndexedSlices` or `None`.

Every helper that must treat a sparse gradient's rows apart from a dense
tensor lives here: sums, quotients, casts, norms, finiteness.
"""

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


def add(a, b):
    """The sum of two gradients of one variable (`IndexedSlices` of the same rows add values)."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(a.values + b.values, a.indices, a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def divide(grad, denominator):
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values / tf.cast(denominator, grad.values.dtype)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return grad / tf.cast(denominator, grad.dtype)


def cast(grad, dtype):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.cast(grad.values, dtype), grad.indices, grad.dense_shape
        )
    return tf.cast(grad, dtype)


def all_finite(grads):
    """Whether every value of `grads` is finite (a boolean scalar tensor)."""
    return tf.reduce_all(tf.stack([
        tf.reduce_all(tf.math.is_finite(grad.values if isinstance(grad, tf.IndexedSlices) else grad))
        for grad in grads if grad is not None
    ]))


def share_like(grad, share, factor, scale, variable):
    """`share * factor * scale` in the form of `grad` (`None`, dense or the same rows)."""
    if grad is None:
        return None
    if share is None:  # this output does not reach the variable
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(tf.zeros_like(grad.values), grad.indices, grad.dense_shape)
        return tf.zeros_like(grad)
    if isinstance(grad, tf.IndexedSlices) != isinstance(share, tf.IndexedSlices):
        if isinstance(grad, tf.IndexedSlices):
            raise ValueError(
                f"Variable {variable.name!r} receives a sparse gradient from the "
                "whole loss but a dense one from one output's loss: tfaccum cannot "
                "split it by output. Pass sparse_gradients=\"dense\" to the callback."
            )
        share = tf.convert_to_tensor(share)

    def scaled(values):
        values = tf.cast(values, grad.dtype) * factor
        return values if scale is None else values * tf.cast(scale, values.dtype)

    if isinstance(share, tf.IndexedSlices):
        return tf.IndexedSlices(scaled(share.values), share.indices, share.dense_shape)
    return scaled(share)


def minus(grad, shares):
    """`grad` minus `shares` (each `None` where `grad` is; rows of the same indices)."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values - tf.add_n([share.values for share in shares])
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return grad - tf.add_n(shares)
