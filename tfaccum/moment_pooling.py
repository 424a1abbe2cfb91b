"""Mean and variance of a window's samples, pooled micro-batch by micro-batch.

What accumulation-aware batch normalization moves its statistics towards:
every sample of the window together, as the large batch's layer sees them.
Each micro-batch (or device's share) is summarised as `(count, mean, m2)`,
`m2` the sum of squared deviations from its mean; `combine` adds two exactly
(Chan, Golub and LeVeque's parallel algorithm), so the variance holds the
spread between micro-batches as well as within them. Written against the
array namespace a backend passes as `ops` (`tf`, `jax.numpy`, `numpy`):
anything with `maximum` and the arithmetic operators.

Example:

>>> a = (4.0, 1.0, 2.0)   # 4 samples, mean 1, squared deviations 2
>>> b = (2.0, 4.0, 0.0)
>>> count, mean, m2 = combine(a, b, numpy)
>>> mean_and_variance(count, mean, m2, numpy)   # (2.0, 2.333...)
"""


def combine(a, b, ops):
    """The `(count, mean, m2)` of the samples of `a` and `b` together."""
    count_a, mean_a, m2_a = a
    count_b, mean_b, m2_b = b
    count = count_a + count_b
    safe_count = ops.maximum(count, 1.0)  # two empty summaries stay empty
    delta = mean_b - mean_a
    m2 = m2_a + m2_b + delta * delta * count_a * count_b / safe_count
    return count, mean_a + delta * count_b / safe_count, m2


def summary(count, mean, variance):
    """`(count, mean, m2)` of `count` samples of this mean and (biased) variance."""
    return count, mean, variance * count


def from_sums(count, total, squares, ops):
    """`(count, mean, m2)` from the count, sum and sum of squares of samples.

    The form several devices add in one all-reduce; `m2` is kept non-negative
    against rounding.
    """
    mean = total / ops.maximum(count, 1.0)
    return count, mean, ops.maximum(squares - count * mean * mean, 0.0)


def to_sums(count, mean, m2):
    """The count, sum and sum of squares of the samples `(count, mean, m2)` summarises."""
    return count, count * mean, m2 + count * mean * mean


def mean_and_variance(count, mean, m2, ops):
    """The samples' mean and (biased) variance; zero for none."""
    return mean, m2 / ops.maximum(count, 1.0)
