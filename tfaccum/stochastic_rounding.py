"""Rounding float32 to bfloat16, up with the probability of the remainder.

A bfloat16 keeps the high 16 bits of a float32. Adding a uniform draw from
`[0, 2**16)` to the float32's bit pattern before dropping the low bits
carries into the kept bits with the probability of what is dropped, so the
rounded value is the float32 on average (Gupta et al. 2015, "Deep Learning
with Limited Numerical Precision"). Values bfloat16 holds (the low bits
zero) and infinities are kept; NaN stays NaN. A backend reads the bits
(`tf.bitcast`, `jax.lax.bitcast_convert_type`), draws the noise and casts;
the arithmetic is here.
"""

NOISE_BOUND = 1 << 16  # the float32 bits a bfloat16 drops: draws lie in [0, NOISE_BOUND)
_KEPT_BITS = -NOISE_BOUND  # as an int32 mask: 0xFFFF0000


def round_bits(bits, noise):
    """The bit patterns of float32 `bits` (int32) rounded stochastically to bfloat16's.

    Args:
        bits: int32 bit patterns of float32 values.
        noise: int32 draws, uniform in `[0, NOISE_BOUND)`, of `bits`' shape.

    Returns:
        int32 bit patterns whose low 16 bits are zero: read as float32 they
        cast to bfloat16 exactly.

    Example:

    >>> bits = numpy.float32([1.0 + 2.0**-10]).view(numpy.int32)  # between two bfloat16s
    >>> round_bits(bits, numpy.int32([0])).view(numpy.float32)        # [1.0]
    >>> round_bits(bits, numpy.int32([0xFFFF])).view(numpy.float32)   # [1.0078125]
    """
    return (bits + noise) & _KEPT_BITS
