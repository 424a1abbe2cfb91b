"""Outputs whose losses average over counts of their own, accumulated apart (PyTorch).

A model whose outputs are masked differently (a per-token head and a
per-sequence head) divides each output's loss by its own count; the large
batch divides each by its window total. One weight per micro-batch cannot do
that: each such output's gradient (taken apart with `torch.autograd.grad`,
the graph kept for the rest's `backward()`) is accumulated in a set of its
own, times its count (its loss as a sum), and divided by its window's total
when the window ends (`tfaccum.output_weighting`, as on the other backends);
the hook's accumulators keep the rest (outputs that count samples,
regularization), weighted by samples. Memory: one more accumulator per
variable per such output.
"""

import torch

from tfaccum import output_weighting
from tfaccum.backend.torch.step import Accumulators


def counted_apart(outputs, said):
    """The compiled losses' outputs that count items of their own, where two or
    more outputs are compiled and no `count_items()` says the step's count; else `[]`."""
    if len(outputs) < 2 or said:
        return []
    return [output for output in outputs if output.count is not None]


def whole_gradient(grads, apart):
    """A micro-batch's whole gradient: the rest's `grads` plus each output's
    (`apart`, or `None` where nothing was taken apart)."""
    if apart is None:
        return grads
    whole = []
    for shares in zip(grads, *apart):
        present = [g for g in shares if g is not None]
        whole.append(sum(present[1:], present[0]) if present else None)
    return whole


class OutputChannels:
    """The outputs a window accumulates apart, and what it holds of each.

    Args:
        outputs: `counted_apart`'s records at the first micro-batch.
        variables: The trainable variables.
        dtype: The accumulators' dtype (`"float32"` or `"bfloat16"`).
    """

    def __init__(self, outputs, variables, dtype):
        self.names = [output.name for output in outputs]
        self.weights = output_weighting.loss_weights([output.weight for output in outputs])
        self.sums = [Accumulators(variables, dtype) for _ in self.names]
        self.totals = [0.0] * len(self.names)  # each output's count over the window
        self.loss_sums = [0.0] * len(self.names)  # its loss times its count, summed
        self.rest_loss_sum = 0.0  # the rest's loss times samples, summed

    def __repr__(self):
        return f"OutputChannels({self.names})"

    def gradients(self, outputs, variables, scale):
        """Each output's gradient of its weighted loss times the loss `scale`."""
        params = [variable.value for variable in variables]
        return [list(torch.autograd.grad(weight * scale * output.value, params,
                                         retain_graph=True, allow_unused=True))
                for weight, output in zip(self.weights, outputs)]

    def rest(self, loss, outputs):
        """The micro-batch's loss less the outputs' accumulated apart."""
        return loss - sum(weight * output.value for weight, output in zip(self.weights, outputs))

    def add(self, apart, outputs, rest, samples, restart):
        """Adds one micro-batch: each output's gradient (`apart`) times its count."""
        for k, (grads, output) in enumerate(zip(apart, outputs)):
            count = float(output.count)
            value = float(output.value.detach())
            self.sums[k].add(grads, count, restart)
            self.totals[k] = (0.0 if restart else self.totals[k]) + count
            self.loss_sums[k] = (0.0 if restart else self.loss_sums[k]) + count * value
        rest_loss = float(rest.detach()) * samples
        self.rest_loss_sum = rest_loss + (0.0 if restart else self.rest_loss_sum)

    def combine(self, grads):
        """`grads` (the rest's, normalised) plus each output's sum over its total."""
        with torch.no_grad():
            for sums, total in zip(self.sums, self.totals):
                divisor = output_weighting.divisor(total, 1.0, _Max)
                for grad, held in zip(grads, sums):
                    grad.add_(held.to(grad.dtype), alpha=1.0 / divisor)
        return grads

    def window_loss(self, samples):
        """The window's loss as the large batch's (`samples`: the window's kept)."""
        return self.rest_loss_sum / max(samples, 1) + output_weighting.window_loss(
            self.weights, self.loss_sums, self.totals, 1.0, _Max)


class _Max:
    """The one array operation `output_weighting` asks for, on host numbers."""

    maximum = staticmethod(max)
