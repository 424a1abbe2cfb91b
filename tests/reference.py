"""The oracle: plain Keras at the large batch, window by window, against tfaccum.

`windows()` says which samples each optimizer update of an accumulated `fit`
holds (micro-batches in order, `leftover` at epoch ends, micro-batches left
out for non-finite gradients), independently of tfaccum's own bookkeeping.
`train_large_batches()` trains a plain Keras model with one `train_on_batch`
per such window: the large batch. `fit_accumulated()` runs tfaccum and
records the weights after every update, so the two compare update for update.
"""

import math

import numpy as np
from conftest import keras

from tfaccum import GradientAccumulationCallback


def max_diff(a, b):
    """Largest absolute difference between two lists of weight arrays."""
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b, strict=True))


def _iterations(model):
    optimizer = model.optimizer
    optimizer = getattr(optimizer, "inner_optimizer", None) or optimizer
    return int(optimizer.iterations.numpy())


class UpdateRecorder(keras.callbacks.Callback):
    """The model's weights after every optimizer update (put it after the accumulation callback)."""

    def __init__(self):
        super().__init__()
        self.weights = []
        self._seen = None

    def _record(self):
        iterations = _iterations(self.model)
        if self._seen is None:
            self._seen = iterations
        while self._seen < iterations:  # at most one update between two calls
            self._seen += 1
            self.weights.append([np.array(w) for w in self.model.get_weights()])

    def on_train_begin(self, logs=None):
        self._seen = _iterations(self.model)

    def on_train_batch_end(self, batch, logs=None):
        self._record()

    def on_epoch_end(self, epoch, logs=None):
        self._record()

    def on_train_end(self, logs=None):
        self._record()


def micro_batches(n, micro):
    """Sample indices of each micro-batch of one epoch (`shuffle=False`)."""
    return [list(range(start, min(start + micro, n))) for start in range(0, n, micro)]


def windows(n, micro, steps, epochs=1, leftover="flush", left_out=()):
    """Sample indices of each update of an accumulated `fit`, in order.

    Args:
        n: Samples per epoch.
        micro: Micro-batch size.
        steps: `accumulation_steps`.
        epochs: Epochs of the `fit`.
        leftover: The callback's policy for a partial window at an epoch end.
        left_out: `(epoch, micro-batch index)` pairs whose gradient is
            non-finite: they take a place in their window but add nothing.

    Returns:
        A list of sample-index lists, one per update (windows that hold only
        left-out micro-batches make no update and are not listed).
    """
    updates, window, count = [], [], 0

    def end():
        nonlocal window, count
        if window:
            updates.append(window)
        window, count = [], 0

    for epoch in range(epochs):
        for index, batch in enumerate(micro_batches(n, micro)):
            if (epoch, index) not in left_out:
                window = window + batch
            count += 1
            if count == steps:
                end()
        if count and leftover == "flush":
            end()
        elif count and leftover == "drop":
            window, count = [], 0
    end()  # what `carry` leaves is applied when `fit` ends
    return updates


def train_large_batches(model, x, y, updates, sample_weight=None, class_weight=None):
    """Trains `model` plainly with one batch per update; returns its weights after each."""
    weights = []
    for indices in updates:
        kwargs = {}
        if sample_weight is not None:
            kwargs["sample_weight"] = sample_weight[indices]
        if class_weight is not None:
            kwargs["class_weight"] = class_weight
        model.train_on_batch(_take(x, indices), _take(y, indices), **kwargs)
        weights.append([np.array(w) for w in model.get_weights()])
    return weights


def _take(data, indices):
    if isinstance(data, dict):
        return {k: v[indices] for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(v[indices] for v in data)
    return data[indices]


def fit_accumulated(model, x, y, *, micro, steps, epochs=1, callback=None, **fit_kwargs):
    """Fits `model` with tfaccum; returns `(weights after each update, callback)`."""
    callback = callback or GradientAccumulationCallback(accumulation_steps=steps)
    recorder = UpdateRecorder()
    model.fit(x, y, batch_size=micro, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[callback, recorder], **fit_kwargs)
    return recorder.weights, callback


def largest_update_diff(ours, theirs):
    """Largest weight difference over all updates (both runs must make the same number)."""
    assert len(ours) == len(theirs), f"{len(ours)} updates against {len(theirs)}"
    return max((max_diff(a, b) for a, b in zip(ours, theirs)), default=0.0)


def all_finite(weights):
    return all(np.all(np.isfinite(w)) for w in weights)


def ceil_div(a, b):
    return int(math.ceil(a / b))
