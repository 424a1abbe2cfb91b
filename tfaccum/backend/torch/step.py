"""One micro-batch's gradient added to the window, and the window's update, eagerly.

The window's sum lives in float32 tensors beside the variables (one copy of
the trainable weights: Keras' own accumulation keeps two). Each micro-batch's
`.grad` is added times its weight in place; at the window's end the sum is
divided in place and handed to the optimizer once, so that clipping, weight
decay, EMA, loss scaling and schedules act once per window, as at the large
batch.
"""

import torch

from tfaccum import stochastic_rounding


def squared_norm(tensors):
    """The squared L2 norm of `tensors` together (float32, on their device).

    A dot product of each with itself: one pass, no squared copy (the noise
    scale takes it of every micro-batch's gradient)."""
    flat = [t.reshape(-1).float() for t in tensors if t is not None]
    return sum(torch.dot(f, f) for f in flat)


def all_finite(grads):
    """Whether every gradient is finite (one read on the host)."""
    return all(bool(torch.isfinite(g).all()) for g in grads if g is not None)


def stochastic_round(x):
    """float32 `x` rounded to bfloat16, up with the probability of the remainder
    (the arithmetic is `tfaccum.stochastic_rounding`'s; torch's generator draws,
    seeded by `keras.utils.set_random_seed`)."""
    noise = torch.randint(0, stochastic_rounding.NOISE_BOUND, x.shape, dtype=torch.int32,
                          device=x.device)
    bits = stochastic_rounding.round_bits(x.view(torch.int32), noise)
    return bits.view(torch.float32).to(torch.bfloat16)  # the low bits are zero: exact


class Accumulators:
    """The open window's summed gradient, one tensor per trainable variable.

    Args:
        variables: The trainable variables.
        dtype: `"float32"`, or `"bfloat16"`: each addition is made in float32
            and rounded once, stochastically, so the sum is float32's on average.
    """

    def __init__(self, variables, dtype="float32"):
        self.dtype = getattr(torch, dtype)
        self.sums = [torch.zeros(tuple(v.shape), dtype=self.dtype, device=v.value.device)
                     for v in variables]

    def __iter__(self):
        return iter(self.sums)

    def add(self, grads, factor, restart):
        """Adds `grads` times `factor` (`None`: as they are); `restart` overwrites
        what the window held (its first micro-batch kept, or the first that
        counts items after micro-batches that counted none)."""
        alpha = 1.0 if factor is None else float(factor)
        with torch.no_grad():
            for total, grad in zip(self.sums, grads):
                if restart:
                    total.zero_()
                if grad is None:
                    continue
                if self.dtype == torch.float32:
                    total.add_(grad.float(), alpha=alpha)
                else:
                    total.copy_(stochastic_round(total.float().add_(grad.float(), alpha=alpha)))

    def scale(self, factor):
        with torch.no_grad():
            for total in self.sums:
                total.mul_(factor)

    def divided(self, denominator, dtypes):
        """The window's gradient, in the variables' dtypes: the float32 sum
        divided in place, or a bfloat16 sum's quotient in float32."""
        with torch.no_grad():
            if self.dtype != torch.float32:
                quotients = [total.float() for total in self.sums]
            else:
                quotients = self.sums
            if denominator is not None:
                for total in quotients:
                    total.div_(float(denominator))
        return [total if dtype == torch.float32 else total.to(dtype)
                for total, dtype in zip(quotients, dtypes)]
