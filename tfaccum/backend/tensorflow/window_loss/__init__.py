"""Window-wide losses on TensorFlow, a feature the hook composes.

`losses` (`WindowLoss`, `InBatchSoftmax`, `NTXent`, and what a model compiled
with one may meet) and `gradient_cache` (the train step that trains such a
loss exactly by gradient caching, `CachingStep`). The hook picks that step
when `losses.window_loss_of(model)` finds one.
"""
