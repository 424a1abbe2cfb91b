"""Keras 3's PyTorch backend: eager micro-steps, the window applied through the optimizer.

`hook.py` (the hook, the same public surface as the other backends'),
`step.py` (one micro-batch's gradient added to the window, and the window's
update), `output_channels.py` (outputs that count apart) and
`_keras_on_torch.py` (what the PyTorch trainer is read for). The counts, the
reductions, the observers and the dashboard's summaries are the core's.
`BACKEND` is what the callback asks.
"""

from tfaccum.backend import Backend
from tfaccum.backend.torch.hook import AccumulationHook
from tfaccum.window_summaries import WindowSummaries


class TorchBackend(Backend):
    """Keras 3 on PyTorch (one process, one device)."""

    name = "torch"
    hook_class = AccumulationHook
    summaries_class = WindowSummaries

    def writes_summaries(self, model):
        return True

    def layer_observer_kinds(self, model):
        return []

    def layer_observers(self, model):
        return []


BACKEND = TorchBackend()
