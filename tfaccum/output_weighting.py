"""The arithmetic of outputs whose losses average over counts of their own.

A model whose outputs are masked differently (a per-token head and a
per-sequence head) divides each output's loss by its own count, and the
large batch divides each by its total over the window. So each such output
is accumulated apart: a micro-batch's gradient of that output weighted by
its count (its loss as a sum), and the window's sum divided by the output's
total. A backend keeps the accumulators; the weighting is here, written
against the array namespace it passes as `ops`.

`loss_share` is what Keras multiplies a device's loss by (1 on one device):
the gradients a device computes carry it, the large batch's do not.

Example:

>>> # Two micro-batches of one output: 3 tokens with loss sum 6, 1 with loss 2.
>>> window_loss([0.5], [6.0 + 2.0], [4.0], 1.0, numpy)   # 0.5 * 8 / 4 = 1.0
"""


def loss_weights(weights):
    """Each output's `loss_weights` entry as a number (`None`: 1)."""
    return [1.0 if weight is None else float(weight) for weight in weights]


def divisor(total, loss_share, ops):
    """What an output's accumulated gradient is divided by: its window total.

    A window whose output counted nothing divides by one (its sum is zero).
    """
    return ops.maximum(total, 1.0) * loss_share


def window_loss(weights, loss_sums, totals, loss_share, ops):
    """The outputs' part of the window's loss: each one's weighted mean over its total.

    Args:
        weights: Each output's `loss_weights` entry (a number).
        loss_sums: Each output's loss summed over the window (weighted by count).
        totals: Each output's count over the window.
        loss_share: As the module says.
        ops: The backend's array namespace.
    """
    return sum(
        weight * loss_sum / ops.maximum(total, 1.0) / loss_share
        for weight, loss_sum, total in zip(weights, loss_sums, totals)
    )
