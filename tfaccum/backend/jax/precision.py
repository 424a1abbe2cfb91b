"""bfloat16 accumulators on JAX: each micro-step adds in float32 and rounds once,
stochastically (the arithmetic is `tfaccum.stochastic_rounding`'s; why, in
`tfaccum.backend.tensorflow.precision`).

XLA fuses the read, the addition, the draw and the rounding into one pass
over each accumulator (`noise`), so no float32 copy of it, nor a buffer of
random bits, is kept.
"""

import jax
import jax.numpy as jnp

from tfaccum import stochastic_rounding


def _mix(h):
    """A 32-bit integer hash (murmur3's finaliser): each output bit depends on every input bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def noise(shape, seed):
    """Uniform int32 draws in `[0, NOISE_BOUND)`, one per element, from a uint32 `seed`.

    Each element hashes its index with the seed: elementwise integer
    arithmetic, which XLA fuses into the pass that adds and rounds (JAX's
    generators materialise their bits, a buffer the size of the
    accumulator, and threefry costs more than the addition it serves).
    """
    size = 1
    for dim in shape:
        size *= dim
    index = jax.lax.iota(jnp.uint32, size).reshape(shape)
    bits = _mix(index * jnp.uint32(0x9E3779B1) + _mix(jnp.asarray(seed, jnp.uint32)))
    return (bits >> 16).astype(jnp.int32)  # the high bits: the best mixed


def stochastic_round(x, seed):
    """`x` rounded to bfloat16, up with the probability of the remainder.

    Values bfloat16 holds and infinities are kept; NaN stays NaN.

    Args:
        x: A float array.
        seed: A uint32 scalar; each element draws its own bits from it.

    Example:

    >>> x = jnp.full([100_000], 1.0 + 2.0**-10)  # between two bfloat16 values
    >>> float(stochastic_round(x, 0).astype(jnp.float32).mean())  # ~1.000977
    """
    x = jnp.asarray(x, jnp.float32)
    bits = stochastic_rounding.round_bits(jax.lax.bitcast_convert_type(x, jnp.int32),
                                          noise(x.shape, seed))
    # The low bits are zero: the cast is exact.
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16)


class Rounding:
    """How a window's sums are stored: as computed (float32), or rounded to bfloat16.

    Args:
        dtype: `"float32"` or `"bfloat16"` (the hook's `accumulator_dtype`).
        seed: The hook's random seed (a Python int): every micro-step draws
            from it, its micro-step's number and its device's.
    """

    def __init__(self, dtype, seed=0):
        self.dtype = dtype
        self.seed = seed

    @property
    def rounds(self):
        return self.dtype == "bfloat16"

    def store(self, values, step, device=None):
        """`values` (float32 arrays) as the accumulators hold them.

        Args:
            step: The micro-step's number (a traced int32 scalar).
            device: The index of the device adding its share, or `None` at a
                window's end, where every device must draw alike.
        """
        if not self.rounds:
            return values
        # A seed per micro-step, caller and variable, mixed apart.
        seed = _mix(jnp.uint32(self.seed) ^ _mix(jnp.asarray(step).astype(jnp.uint32)))
        stream = 0 if device is None else jnp.asarray(device).astype(jnp.uint32) + 1
        seed = _mix(seed + jnp.uint32(0x68E31DA4) * jnp.asarray(stream, jnp.uint32))
        return [stochastic_round(v, _mix(seed + jnp.uint32(i) * jnp.uint32(0x1B873593)))
                for i, v in enumerate(values)]
