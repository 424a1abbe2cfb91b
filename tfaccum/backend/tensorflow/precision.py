"""Reduced-precision accumulators: bfloat16 windows summed without drift.

A bfloat16 accumulator halves what a window holds (8 bits of mantissa
instead of 24). Adding each micro-batch by round-to-nearest loses what is
smaller than half a unit in the last place of the running sum, and the
loss grows with the window (the later micro-batches are rounded against a
larger sum). Here each micro-step adds in float32 (the accumulator read,
plus the micro-batch's gradient) and rounds once, stochastically: up with
the probability of the remainder, so the stored sum is the float32 sum on
average (Gupta et al. 2015, "Deep Learning with Limited Numerical
Precision"). `benchmarks/precision.py` measures both against float32.
"""

import tensorflow as tf

from tfaccum import stochastic_rounding


def stochastic_round(x, seed=None):
    """Rounds a float32 tensor to bfloat16, up with the probability of the remainder.

    Values bfloat16 holds exactly and infinities are kept; NaN stays NaN.
    Each element draws its own random bits (an int32 tensor of `x`'s
    shape: `BFloat16Sum` rounds large variables in slices).

    Args:
        x: A float tensor.
        seed: A `[2]` int64 seed to draw from statelessly (`RoundingSeeds`),
            or `None` for TensorFlow's stateful generator.

    Example:

    >>> x = tf.fill([100_000], 1.0 + 2.0**-10)  # between two bfloat16 values
    >>> float(tf.reduce_mean(tf.cast(stochastic_round(x), tf.float32)))  # ~1.000977
    """
    x = tf.cast(x, tf.float32)
    # Drawn once `x` exists: with nothing to wait for, the draws of every
    # slice ran when the step began and were all alive at once.
    with tf.control_dependencies([x]):
        if seed is None:
            noise = tf.random.uniform(
                tf.shape(x), 0, stochastic_rounding.NOISE_BOUND, dtype=tf.int32)
        else:
            noise = tf.random.stateless_uniform(
                tf.shape(x), seed, 0, stochastic_rounding.NOISE_BOUND, dtype=tf.int32)
    bits = stochastic_rounding.round_bits(tf.bitcast(x, tf.int32), noise)
    # The low bits are zero: the cast is exact.
    return tf.cast(tf.bitcast(bits, tf.float32), tf.bfloat16)


# Elements summed and rounded at once: a variable larger than this is
# added in slices of rows, so its float32 temporaries stay this small.
CHUNK = 1 << 20

# What each rounding of a micro-step folds into its accumulator's seed: an
# addition and a loss scale's rescaling draw apart.
_ADD, _SCALE = 0, 1


class RoundingSeeds:
    """Where a hook's stochastic roundings draw from: a seed, and the micro-step.

    Each rounding draws statelessly from the hook's seed (a variable), the
    number of the micro-step it rounds in and its accumulator's stream. A
    stateful generator's position lives in its kernel and dies with the
    process; these are in the hook's counts and in the seed, which a backup
    holds, so a window resumed in a new process draws what it would have.

    Args:
        strategy: The model's `tf.distribute` strategy.
        micro_step: Returns the number of the micro-step being added (an
            int64 tensor, read inside the step).
    """

    def __init__(self, strategy, micro_step):
        self._micro_step = micro_step
        self._streams = 0
        with tf.init_scope(), strategy.scope():
            self.variable = tf.Variable(_fresh_seed(), trainable=False, name="rounding_seed")

    def renew(self):
        """Draws a new seed (the hook is installed again: its micro-steps count from 0)."""
        self.variable.assign(_fresh_seed())

    def stream(self):
        """A new accumulator's seeds: a function giving its `[2]` seed at this micro-step.

        Streams are numbered as accumulators are made, the same way in every
        process that builds the model alike.
        """
        index = self._streams
        self._streams += 1

        def seed():
            base = tf.stack([self.variable.read_value(), tf.cast(self._micro_step(), tf.int64)])
            return tf.random.experimental.stateless_fold_in(base, index)

        return seed


def _fresh_seed():
    # TensorFlow's global generator: reproducible under `tf.random.set_seed`
    # (as the stateful draws were); Python's, which Keras seeds its own
    # generators from, is left alone.
    with tf.init_scope():
        return tf.random.uniform((), 0, 2**31 - 1, dtype=tf.int64)


class BFloat16Sum:
    """What a dense bfloat16 accumulator does: add in float32, round stochastically.

    A large variable is added in slices of rows (`CHUNK` elements each),
    one after the other: whole, its float32 sum, random bits and rounding
    would hold 2.5 times its bfloat16 accumulator for a moment, more than
    the half parameter copy bfloat16 saves.

    Args:
        variable: The bfloat16 accumulator variable.
        seeds: Returns the `[2]` seed of this micro-step's roundings (a
            `RoundingSeeds.stream()`), or `None`: TensorFlow's stateful
            generator, which a resumed window cannot draw from alike.
    """

    def __init__(self, variable, seeds=None):
        self.variable = variable
        self._seeds = seeds
        shape = variable.shape
        rows = shape[0] if shape.rank else 1
        row_size = max(1, shape.num_elements() // max(rows, 1))
        step = max(1, CHUNK // row_size)
        self._slices = ([slice(start, min(rows, start + step)) for start in range(0, rows, step)]
                        if shape.rank and rows > step else None)

    def add(self, grad, weight):
        if isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
        grad = tf.cast(grad, tf.float32)
        if weight is not None:
            grad = grad * tf.cast(weight, tf.float32)
        self._update(lambda held, rows: held + grad[rows], _ADD)

    def read(self):
        return tf.cast(self.variable.read_value(), tf.float32)

    def scale(self, factor):
        factor = tf.cast(factor, tf.float32)
        self._update(lambda held, rows: held * factor, _SCALE)

    def zero(self):
        """Empties the variable, a slice of rows at a time where it is sliced.

        Written in place: zeros of the whole variable assigned to it were
        allocated beside it, and the assignment made a third buffer (the
        variable, read by rows, copies on a whole read).
        """
        if self._slices is None:
            self.variable.assign(tf.zeros(self.variable.shape, self.variable.dtype))
            return
        for rows in self._slices:
            indices = tf.range(rows.start, rows.stop)
            zeros = tf.zeros([rows.stop - rows.start, *self.variable.shape[1:]],
                             self.variable.dtype)
            self.variable.scatter_update(tf.IndexedSlices(zeros, indices))

    def _seed(self, *salts):
        """The seed of one rounding (`None`: stateful draws)."""
        if self._seeds is None:
            return None
        seed = self._seeds()
        for salt in salts:
            seed = tf.random.experimental.stateless_fold_in(seed, salt)
        return seed

    def _update(self, value_of, kind):
        """Stores `value_of(held, rows)` rounded, a slice of rows at a time."""
        if self._slices is None:  # small, or a scalar: whole
            self.variable.assign(stochastic_round(value_of(self.read(), Ellipsis),
                                                  self._seed(kind)))
            return
        for index, rows in enumerate(self._slices):
            # Rows gathered and scattered: a `variable[rows]` read and a sliced
            # assign each materialise a copy of the whole variable, so only
            # one slice's transient is alive at a time this way.
            indices = tf.range(rows.start, rows.stop)
            held = tf.cast(self.variable.sparse_read(indices), tf.float32)
            self.variable.scatter_update(
                tf.IndexedSlices(stochastic_round(value_of(held, rows), self._seed(kind, index)),
                                 indices))
