"""bfloat16 accumulators on JAX: each micro-step adds in float32 and rounds once,
stochastically (the arithmetic is `tfaccum.stochastic_rounding`'s; why, in
`tfaccum.backend.tensorflow.precision`).

XLA fuses the read, the addition, the draw and the rounding into one pass
over each accumulator, so no float32 copy of it is kept.
"""

import jax
import jax.numpy as jnp

from tfaccum import stochastic_rounding


def stochastic_round(x, key):
    """`x` rounded to bfloat16, up with the probability of the remainder.

    Values bfloat16 holds and infinities are kept; NaN stays NaN.

    Args:
        x: A float array.
        key: A `jax.random` key; each element draws its own bits from it.

    Example:

    >>> x = jnp.full([100_000], 1.0 + 2.0**-10)  # between two bfloat16 values
    >>> float(stochastic_round(x, jax.random.key(0)).astype(jnp.float32).mean())  # ~1.000977
    """
    x = jnp.asarray(x, jnp.float32)
    noise = jax.random.randint(key, x.shape, 0, stochastic_rounding.NOISE_BOUND, jnp.int32)
    bits = stochastic_rounding.round_bits(jax.lax.bitcast_convert_type(x, jnp.int32), noise)
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
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        key = (jax.random.fold_in(key, 0) if device is None
               else jax.random.fold_in(jax.random.fold_in(key, 1), device))
        keys = jax.random.split(key, len(values))
        return [stochastic_round(v, k) for v, k in zip(values, keys)]
