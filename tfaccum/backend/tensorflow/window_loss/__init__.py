"""Window-wide losses on TensorFlow, a feature the hook composes.

The losses are the core's (`tfaccum.window_losses`). `gradient_cache` (the
train step that trains such a loss exactly by gradient caching,
`CachingStep`) and `checks` (what it cannot meet on TensorFlow). The hook
picks that step when `tfaccum.window_losses.window_loss_of(model)` finds one.
"""
