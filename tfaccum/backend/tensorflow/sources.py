"""Where a window's gradients come from when it ends.

The window's end (`devices.py`) is one function for every model: it asks
its source for the gradients to apply, applies them, tells the observers and
resets. A source answers, once per window (`prepare`, in the cross-replica
context with several replicas), then on each replica (`gradients`, `loss`):

- `AccumulatedGradients`: the accumulators' sum (and each output's channel),
  divided by what the reduction says;
- `gradient_cache.CachedGradients`: a window-wide loss's gradient, replayed
  through each micro-batch's forward pass into the accumulators.
"""


class AccumulatedGradients:
    """The window's gradients as the micro-steps summed them.

    Args:
        state: The hook's `WindowState`.
    """

    # Whether the window's sum is divided by the reduction's denominator.
    divides = True
    # Whether the optimizer may skip the update (counted from its iterations).
    may_skip = False

    def __init__(self, state):
        self.state = state

    @property
    def traced(self):
        """Whether a window can be pending (a step has traced)."""
        return self.state.traced

    def prepare(self, window):
        """Work done once per window, before any replica applies it: none."""
        return None

    def gradients(self, prepared, window, denominator):
        """The window's gradients, divided by `denominator` (this replica's)."""
        return self.state.gradients(denominator, window.get("channel_items"))

    def loss(self, prepared, window):
        """The window's loss as the large batch's step reports it, or `None`."""
        return self.state.loss(window) if self.state.loss_seen else None

    def reset(self):
        """Empties what the source holds beside the window state: nothing."""
