"""The oracle, and the one home of what the tests share.

`windows()` says which samples each optimizer update of an accumulated `fit`
holds (micro-batches in order, a schedule of window lengths, `leftover` at
epoch ends, micro-batches or replicas' shares left out for non-finite
gradients), independently of tfaccum's own bookkeeping.
`train_large_batches()` trains a plain Keras model with one `train_on_batch`
per such window: the large batch. `fit_accumulated()` runs tfaccum and records
the weights after every update, and `compare()` does both, so that a test
compares update for update.

Also here: the small models and data every test file uses, `max_diff`, the
recorders and `InterruptAt`. Tests import from this module (conftest.py
configures the session and holds fixtures only).
"""

import dataclasses
import math
import os
import types
import warnings

import numpy as np

from tfaccum import GradientAccumulationCallback
from tfaccum import _keras

# The suite runs on Keras 3, again on Keras 2 (`tf_keras`) with
# TF_USE_LEGACY_KERAS=1, and its core files on Keras 3's JAX backend with
# KERAS_BACKEND=jax (`make test` does all three). Tests take `keras` from here.
if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
    import tensorflow as tf

    keras = tf.keras  # tf_keras, as its users get it
    KERAS = "tf_keras"
    # The few of Keras 3's `ops` the shared tests' losses use, in TensorFlow's.
    ops = types.SimpleNamespace(cast=tf.cast, maximum=tf.maximum, sum=tf.reduce_sum,
                                stack=tf.stack, divide_no_nan=tf.math.divide_no_nan)
else:
    import keras
    from keras import ops

    KERAS = "keras3"
BACKEND = "tensorflow" if KERAS == "tf_keras" else keras.backend.backend()

# What Keras on PyTorch does not run, marked where a test asks for it (the
# `backend` marker of conftest.py; pytest is imported by the tests only).
NOT_ON_TORCH = {
    "jit_compile": "torch.compile (jit_compile=True) is refused by name on torch "
                   "(test_torch.py::test_what_torch_does_not_serve_is_refused_by_name)",
    "steps_per_execution": "Keras' PyTorch trainer refuses steps_per_execution > 1 itself",
    "window_loss": "window-wide losses are refused by name on torch "
                   "(test_torch.py::test_what_torch_does_not_serve_is_refused_by_name)",
    "devices": "distributions are refused by name on torch (Keras has no "
               "keras.distribution there; "
               "test_torch.py::test_what_torch_does_not_serve_is_refused_by_name)",
    "batch_norm": "accumulation-aware batch normalization is refused by name on torch "
                  "(test_torch.py::test_what_torch_does_not_serve_is_refused_by_name)",
}


def not_on_torch(what):
    """The marker of a test of what Keras on PyTorch does not run (`NOT_ON_TORCH`)."""
    import pytest

    return pytest.mark.backend("tensorflow", "jax", reason=NOT_ON_TORCH[what])


# -- data and models ------------------------------------------------------------------


def make_data(n=100, features=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (x @ rng.normal(size=(features, 1)) + 0.1 * rng.normal(size=(n, 1)))
    return x, y.astype("float32")


class SubclassedMLP(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(7, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw_clipnorm": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05, clipnorm=0.1),
    "adam_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9),
}


def make_model(kind="sequential", optimizer="sgd", seed=1, features=5, **compile_kwargs):
    """A small MLP with deterministic weights; `optimizer` is a name or a factory."""
    keras.utils.set_random_seed(seed)
    if kind == "sequential":
        model = keras.Sequential([
            keras.Input((features,)),
            keras.layers.Dense(7, activation="tanh"),
            keras.layers.Dense(1),
        ])
    elif kind == "functional":
        inputs = keras.Input((features,))
        hidden = keras.layers.Dense(7, activation="tanh")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    elif kind == "subclassed":
        model = SubclassedMLP()
        model(np.zeros((1, features), "float32"))  # builds the layers
    else:
        raise ValueError(kind)
    model.compile(
        optimizer=OPTIMIZERS[optimizer]() if isinstance(optimizer, str) else optimizer(),
        loss=compile_kwargs.pop("loss", "mse"),
        **compile_kwargs,
    )
    return model


def mirrored(cross_device_ops=None):
    """Two replicas on the two logical CPUs conftest.py configures.

    Reductions go through one device: TensorFlow's collective ops (the CPU
    default) clash between several strategies in one process, with or
    without tfaccum.
    """
    import tensorflow as tf

    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    assert len(devices) == 2, "conftest configures two logical CPUs"
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=cross_device_ops or tf.distribute.ReductionToOneDevice())


# -- comparing weights ---------------------------------------------------------------------


def weights_of(model_or_weights):
    if hasattr(model_or_weights, "get_weights"):
        return model_or_weights.get_weights()
    return model_or_weights


def max_diff(a, b):
    """Largest absolute difference between two models' (or weight lists') weights."""
    return max((float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
                for u, v in zip(weights_of(a), weights_of(b), strict=True)), default=0.0)


max_weight_diff = max_diff


def refused_then_plain(build, x, y, match, **callback_kwargs):
    """`fit` with the callback is refused with a ValueError matching `match`,
    and the model left trains as one never handed to tfaccum (weights and
    optimizer iterations)."""
    import pytest

    from tfaccum import remove_accumulation_hook

    model = build()
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[
            GradientAccumulationCallback(accumulation_steps=2, **callback_kwargs)])
    assert remove_accumulation_hook(model) is None
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    reference = build()
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert max_diff(model, reference) < 1e-7
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())


def iterations(model):
    """`model.optimizer.iterations` as an int, as its schedules see it.

    (Keras 3 before 3.9 leaves a LossScaleOptimizer's own counter at 0 and
    counts in its inner optimizer.)
    """
    optimizer = model.optimizer
    optimizer = getattr(optimizer, "inner_optimizer", None) or optimizer
    return int(optimizer.iterations.numpy())


def all_finite(weights):
    return all(np.all(np.isfinite(np.asarray(w))) for w in weights)


def largest_update_diff(ours, theirs):
    """Largest weight difference over all updates (both runs must make the same number)."""
    assert len(ours) == len(theirs), f"{len(ours)} updates against {len(theirs)}"
    return max((max_diff(a, b) for a, b in zip(ours, theirs)), default=0.0)


# -- callbacks the tests share -----------------------------------------------------------


class UpdateRecorder(_keras.Callback):
    """The model's weights after every optimizer update (put it after the accumulation callback).

    A callback of either Keras (tfaccum's own base speaks both), so it also
    records tf_keras models in a Keras 3 process.
    """

    def __init__(self):
        super().__init__()
        self.weights = []
        self._seen = None

    def _record(self):
        now = iterations(self.model)
        if self._seen is None:
            self._seen = now
        while self._seen < now:  # at most one update between two calls
            self._seen += 1
            self.weights.append([np.array(w) for w in self.model.get_weights()])

    def on_train_begin(self, logs=None):
        self._seen = iterations(self.model)

    def on_train_batch_end(self, batch, logs=None):
        self._record()

    def on_epoch_end(self, epoch, logs=None):
        self._record()

    def on_train_end(self, logs=None):
        self._record()


class BatchRecorder(keras.callbacks.Callback):
    """The first layer's kernel and the logs after every batch, the weights after every epoch."""

    def __init__(self):
        super().__init__()
        self.kernels = []
        self.logs = []
        self.epoch_weights = []

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(np.array(self.model.layers[0].kernel))
        self.logs.append(dict(logs or {}))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_weights.append(self.model.get_weights())


class InterruptAt(keras.callbacks.Callback):
    """Raises `error` (a RuntimeError by default) after batch `batch` of epoch `epoch`."""

    def __init__(self, epoch=0, batch=0, error=None):
        super().__init__()
        self.at = (epoch, batch)
        self.error = error or RuntimeError("interrupted")
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise self.error


# -- the oracle -------------------------------------------------------------------------------


def micro_batches(n, micro):
    """Sample indices of each micro-batch of one epoch (`shuffle=False`)."""
    return [list(range(start, min(start + micro, n))) for start in range(0, n, micro)]


def windows(n, micro, steps, epochs=1, leftover="flush", left_out=()):
    """Sample indices of each update of an accumulated `fit`, in order.

    Args:
        n: Samples per epoch.
        micro: Micro-batch size.
        steps: `accumulation_steps`: an int, or `epoch -> steps` (the
            callback's schedule), read at each epoch's start.
        epochs: Epochs of the `fit`.
        leftover: The callback's policy for a partial window at an epoch end.
        left_out: `(epoch, micro-batch index)` pairs whose gradient is
            non-finite (they take a place in their window but add nothing),
            or `(epoch, index) -> samples left out of that micro-batch` (a
            replica's share).

    Returns:
        A list of sample-index lists, one per update (windows that hold only
        left-out samples make no update and are not listed).
    """
    if not callable(left_out):
        pairs = set(left_out)
        left_out = lambda epoch, index: (  # noqa: E731
            set(range(n)) if (epoch, index) in pairs else set())
    length = steps if callable(steps) else (lambda epoch: steps)
    updates, window, count = [], [], 0

    def end():
        nonlocal window, count
        if window:
            updates.append(window)
        window, count = [], 0

    for epoch in range(epochs):
        for index, batch in enumerate(micro_batches(n, micro)):
            excluded = left_out(epoch, index)
            window = window + [i for i in batch if i not in excluded]
            count += 1
            if count >= length(epoch):
                end()
        if count and leftover == "flush":
            end()
        elif count and leftover == "drop":
            window, count = [], 0
    end()  # what `carry` leaves is applied when `fit` ends
    return updates


def _take(data, indices):
    if data is None:
        return None
    if isinstance(data, dict):
        return {k: v[indices] for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(v[indices] for v in data)
    return data[indices]


def train_large_batches(model, x, y, updates, sample_weight=None, class_weight=None,
                        finalize=False):
    """Trains `model` plainly with one batch per update; returns its weights after each.

    `finalize`: end as `fit` does (`finalize_variable_values`: an optimizer's
    EMA is written into the weights), after the last weights were recorded.
    """
    steps_per_execution = getattr(model, "_steps_per_execution", None)
    # A tf_keras model's is a variable (in a Keras 3 process too).
    if hasattr(steps_per_execution, "assign") and int(steps_per_execution.numpy()) > 1:
        # tf_keras' `train_on_batch` would pull that many batches from one.
        steps_per_execution.assign(1)
        model.train_function = None
    elif BACKEND == "jax" and getattr(model, "steps_per_execution", 1) > 1:
        # Keras 3.16's JAX `train_on_batch` takes its one batch for a stack of
        # `steps_per_execution` batches (and slices it along the samples).
        model.steps_per_execution = 1
        model.train_function = None
    if model.built:
        # Made now rather than in the first trace, which then happens once
        # (a step that makes variables traces twice); nothing else changes.
        if BACKEND == "tensorflow":  # tf_keras' legacy optimizers build otherwise
            from tfaccum.backend.tensorflow import _keras_on_tf

            _keras_on_tf.api_for(model).build_optimizer(model.optimizer,
                                                        model.trainable_variables)
        elif not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
    weights = []
    for indices in updates:
        indices = np.asarray(indices)
        kwargs = {}
        if sample_weight is not None:
            kwargs["sample_weight"] = sample_weight[indices]
        if class_weight is not None:
            kwargs["class_weight"] = class_weight
        model.train_on_batch(_take(x, indices), _take(y, indices), **kwargs)
        weights.append([np.array(w) for w in model.get_weights()])
    if finalize:
        model.optimizer.finalize_variable_values(model.trainable_variables)
    return weights


def fit_accumulated(model, x, y, *, micro, steps, epochs=1, callback=None, **fit_kwargs):
    """Fits `model` with tfaccum; returns `(weights after each update, callback)`."""
    callback = callback or GradientAccumulationCallback(accumulation_steps=steps)
    recorder = UpdateRecorder()
    callbacks = [callback, recorder, *fit_kwargs.pop("callbacks", [])]
    model.fit(x, y, batch_size=micro, epochs=epochs, shuffle=False, verbose=0,
              callbacks=callbacks, **fit_kwargs)
    return recorder.weights, callback


@dataclasses.dataclass
class Comparison:
    """tfaccum's run and the large batch's, update for update."""

    model: object  # tfaccum's model, after its `fit`
    reference: object  # the plain one, after its large batches
    callback: object
    ours: list  # weights after each of tfaccum's updates
    theirs: list  # weights after each large batch
    updates: list  # the oracle's windows: sample indices per update

    @property
    def diff(self):
        """Largest weight difference over every update."""
        return largest_update_diff(self.ours, self.theirs)

    def moved(self, build):
        """How far training moved the weights from `build()`'s (the comparison means something)."""
        return max_diff(build(), self.model)


def compare(build, x, y=None, *, micro, steps, epochs=1, leftover="flush", left_out=(),
            callback_kwargs=None, sample_weight=None, class_weight=None, strategy=None,
            build_reference=None, **fit_kwargs):
    """tfaccum against the large batch: both trained from `build()`, recorded per update.

    Args:
        build: Makes a compiled model, the same each call.
        x, y: The data (arrays), in micro-batches of `micro` without shuffling.
        steps: `accumulation_steps` (an int, a dict or a callable).
        leftover, left_out: As for `windows()`; the callback gets `leftover`.
        callback_kwargs: More arguments for `GradientAccumulationCallback`.
        sample_weight, class_weight: For both runs.
        strategy: Builds tfaccum's model in `strategy.scope()` (the reference
            trains on one device).
        build_reference: Makes the reference model, if not `build`.
        **fit_kwargs: More arguments for tfaccum's `fit`.
    """
    callback = GradientAccumulationCallback(
        accumulation_steps=steps, leftover=leftover, **(callback_kwargs or {}))
    schedule = steps if isinstance(steps, int) else callback.schedule
    updates = windows(len(y if x is None else _first(x)), micro, schedule, epochs, leftover,
                      left_out)
    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    ours, callback = fit_accumulated(
        model, x, y, micro=micro, steps=steps, epochs=epochs, callback=callback,
        sample_weight=sample_weight, class_weight=class_weight, **fit_kwargs)
    reference = (build_reference or build)()
    finalize = getattr(reference.optimizer, "use_ema", False)
    theirs = train_large_batches(reference, x, y, updates, sample_weight=sample_weight,
                                 class_weight=class_weight, finalize=finalize)
    return Comparison(model=model, reference=reference, callback=callback, ours=ours,
                      theirs=theirs, updates=updates)


def fit_with_and_without(build, x, y=None, **fit_kwargs):
    """The transparency pair: `fit` plainly, and `fit` with the callback at `accumulation_steps=1`.

    Both from `build()`, with the same arguments; each run's weights are
    recorded after every update. Returns a `Comparison` whose `reference` is
    the plain run.
    """
    fit_kwargs = dict(fit_kwargs)
    others = fit_kwargs.pop("callbacks", [])
    fit_kwargs.setdefault("shuffle", False)
    fit_kwargs.setdefault("verbose", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "no trainable weights", both alike
        plain, plain_updates = build(), UpdateRecorder()
        plain.fit(x, y, callbacks=[plain_updates, *others], **fit_kwargs)
        model, updates = build(), UpdateRecorder()
        callback = GradientAccumulationCallback(accumulation_steps=1)
        model.fit(x, y, callbacks=[callback, updates, *others], **fit_kwargs)
    return Comparison(model=model, reference=plain, callback=callback, ours=updates.weights,
                      theirs=plain_updates.weights, updates=None)


def _first(x):
    if isinstance(x, dict):
        return next(iter(x.values()))
    if isinstance(x, (list, tuple)):
        return x[0]
    return x


def read_run(log_dir):
    """{tag: [(step, value)]} and {tag: SummaryMetadata} of a run's event files,
    through TensorBoard's Python loader (no TensorFlow needed)."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    accumulator = event_accumulator.EventAccumulator(
        log_dir, size_guidance={event_accumulator.TENSORS: 0})
    accumulator.Reload()
    series, metas = {}, {}
    for tag in accumulator.Tags()[event_accumulator.TENSORS]:
        events = accumulator.Tensors(tag)
        series[tag] = [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in events]
        metas[tag] = accumulator.SummaryMetadata(tag)
    return series, metas


def ceil_div(a, b):
    return int(math.ceil(a / b))
