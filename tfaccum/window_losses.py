"""Window-wide losses: losses that couple the samples of a batch (in-batch negatives).

A loss such as a two-tower model's in-batch softmax scores each query against
every document of its batch. Accumulated micro-batch by micro-batch it would
see only its micro-batch's negatives; compiled as a `WindowLoss`, the
accumulation hook computes it over the whole window instead (gradient
caching: each backend's `gradient_cache` part), so a window of micro-batches
trains exactly as the large batch. Without the hook a `WindowLoss` is an
ordinary Keras loss over its batch.

A window loss maps `(y_true, y_pred)` of a whole batch to one loss per
sample, shape `(batch,)`; Keras averages it (with `sample_weight`) as it does
any loss. The losses here are written in `keras.ops`: one definition serves
every backend (and tf_keras, whose tensors Keras 3's TensorFlow ops take).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tfaccum.reduction import Auto


def _ops():
    from keras import ops  # imported when first called: `import tfaccum` loads no Keras

    return ops


class WindowLoss:
    """A loss computed over the whole accumulation window, not each micro-batch.

    Compile a model with it (`model.compile(loss=tfaccum.WindowLoss(fn))`) and
    train with `GradientAccumulationCallback`: each micro-batch's outputs are
    kept, the loss is computed over the window's outputs when it ends, and
    each micro-batch's forward pass is run again to carry that loss's
    gradient to the weights. The update is the large batch's. Without the
    callback it is `fn` over the batch, as Keras calls any loss.

    Args:
        fn: `fn(y_true, y_pred) -> per-sample losses` (shape `(batch,)`),
            computed with the whole batch in view (e.g. in-batch negatives).
            Written in `keras.ops`, it serves every backend. Subclasses
            implement `call()` instead.
        name: The loss's name. Defaults to `fn`'s (or the class's) name.

    Example:

    ```python
    from keras import ops

    def in_batch(y_true, y_pred):   # y_pred: [queries | documents]
        q, d = ops.split(y_pred, 2, axis=-1)
        logits = ops.matmul(q, ops.transpose(d))
        labels = ops.arange(ops.shape(logits)[0])
        return ops.sparse_categorical_crossentropy(labels, logits, from_logits=True)

    model.compile(optimizer="adam", loss=tfaccum.WindowLoss(in_batch))
    model.fit(x, y, batch_size=32, callbacks=[
        tfaccum.GradientAccumulationCallback(accumulation_steps=8)])  # 256 negatives
    ```
    """

    def __init__(self, fn: Callable | None = None, *, name: str | None = None):
        if fn is not None and not callable(fn):
            raise TypeError(
                f"`fn` must be a callable `fn(y_true, y_pred)` returning one loss per "
                f"sample. Received: fn={fn!r}")
        if fn is None and type(self).call is WindowLoss.call:
            raise TypeError(
                "`WindowLoss` needs `fn`, a callable `fn(y_true, y_pred)` returning one "
                "loss per sample (or a subclass that implements `call`). Received: fn=None")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", None) or _snake(type(self).__name__)
        # Keras names a wrapped callable loss after its `__name__`.
        self.__name__ = self.name

    def call(self, y_true, y_pred):
        """Per-sample losses of a whole batch (or window)."""
        return self.fn(y_true, y_pred)

    def __call__(self, y_true, y_pred, **kwargs):
        if kwargs:
            raise TypeError(
                f"A `WindowLoss` is called with `(y_true, y_pred)` only. "
                f"Received: {sorted(kwargs)}")
        return self.call(y_true, y_pred)

    def get_config(self):
        return {"name": self.name}

    def __repr__(self):
        return f"{type(self).__name__}(name={self.name!r})"


class InBatchSoftmax(WindowLoss):
    """In-batch softmax of a two-tower model: each query against every document.

    `y_pred` holds a query and its positive document per sample, side by
    side: `[query | document]` along the last axis (e.g. a `Concatenate` of
    the towers); every other document of the batch (the window, under the
    callback) is a negative. `y_true` is not read.

    Args:
        temperature: Logits are similarities divided by it (a float > 0), or
            `"learned"`: `y_pred` then ends with one more column, the log of
            the logit scale (CLIP's `logit_scale`, e.g. from a trainable
            weight broadcast over the batch), which trains with the model.
            Defaults to 0.05.
        symmetric: Also score each document against every query and average
            the two directions (CLIP's loss). Defaults to `False`.
        normalize: Compare L2-normalised embeddings (cosine similarity).
            Defaults to `True`.
        name: Defaults to `"in_batch_softmax"`.

    Example:

    ```python
    outputs = keras.layers.Concatenate()([query_tower(q), document_tower(d)])
    model = keras.Model([q, d], outputs)
    model.compile("adam", loss=tfaccum.InBatchSoftmax(temperature=0.05))
    ```
    """

    def __init__(self, temperature: float | str = 0.05, *, symmetric: bool = False,
                 normalize: bool = True, name: str | None = None):
        if temperature != "learned":
            _check_temperature(temperature)
        self.temperature = temperature
        self.symmetric = bool(symmetric)
        self.normalize = bool(normalize)
        super().__init__(name=name or "in_batch_softmax")

    def call(self, y_true, y_pred):
        ops = _ops()
        y_pred = ops.convert_to_tensor(y_pred)
        if self.temperature == "learned":
            embeddings, log_scale = y_pred[:, :-1], y_pred[:, -1:]
            scale = ops.exp(ops.cast(log_scale, "float32"))
        else:
            embeddings, scale = y_pred, 1.0 / self.temperature
        _check_even(embeddings, "InBatchSoftmax", "[query | document]")
        queries, documents = ops.split(ops.cast(embeddings, "float32"), 2, axis=-1)
        if self.normalize:
            queries, documents = _l2_normalize(queries), _l2_normalize(documents)
        similarity = ops.matmul(queries, ops.transpose(documents))
        labels = ops.arange(ops.shape(similarity)[0])
        forward = ops.sparse_categorical_crossentropy(labels, similarity * scale,
                                                      from_logits=True)
        if not self.symmetric:
            return forward
        # Every row's scale is the same: one scale, whichever way it is read.
        backward = ops.sparse_categorical_crossentropy(
            labels, ops.transpose(similarity) * scale, from_logits=True)
        return (forward + backward) / 2.0

    def get_config(self):
        return {"temperature": self.temperature, "symmetric": self.symmetric,
                "normalize": self.normalize, "name": self.name}

    def __repr__(self):
        return (f"InBatchSoftmax(temperature={self.temperature!r}, "
                f"symmetric={self.symmetric}, normalize={self.normalize})")


class NTXent(WindowLoss):
    """SimCLR's NT-Xent: two views per sample, each view's positive is the other.

    `y_pred` holds the two views' projections side by side, `[view 1 |
    view 2]`; each of the 2 * batch projections is scored against all others
    (itself left out), and the sample's loss is the mean of its two views'.
    `y_true` is not read.

    Args:
        temperature: A float > 0. Defaults to 0.5.
        name: Defaults to `"nt_xent"`.

    Example:

    ```python
    outputs = keras.layers.Concatenate()([encoder(view_1), encoder(view_2)])
    model = keras.Model([view_1, view_2], outputs)
    model.compile("adam", loss=tfaccum.NTXent(temperature=0.5))
    ```
    """

    def __init__(self, temperature: float = 0.5, *, name: str | None = None):
        _check_temperature(temperature)
        self.temperature = float(temperature)
        super().__init__(name=name or "nt_xent")

    def call(self, y_true, y_pred):
        ops = _ops()
        y_pred = ops.cast(ops.convert_to_tensor(y_pred), "float32")
        _check_even(y_pred, "NTXent", "[view 1 | view 2]")
        first, second = ops.split(y_pred, 2, axis=-1)
        views = _l2_normalize(ops.concatenate([first, second], axis=0))
        n = ops.shape(first)[0]
        logits = ops.matmul(views, ops.transpose(views)) / self.temperature
        logits = logits - ops.eye(2 * n) * 1e9  # a view is not its own negative
        labels = ops.concatenate([ops.arange(n, 2 * n), ops.arange(n)], axis=0)
        losses = ops.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        return (losses[:n] + losses[n:]) / 2.0

    def get_config(self):
        return {"temperature": self.temperature, "name": self.name}

    def __repr__(self):
        return f"NTXent(temperature={self.temperature!r})"


def _l2_normalize(x):
    # As `tf.math.l2_normalize`: a zero vector stays zero.
    ops = _ops()
    return x * ops.rsqrt(ops.maximum(ops.sum(ops.square(x), axis=-1, keepdims=True), 1e-12))


def _check_temperature(temperature):
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature) or temperature <= 0):
        raise ValueError(
            f"`temperature` must be a float > 0 (or \"learned\" for `InBatchSoftmax`). "
            f"Received: temperature={temperature!r}")


def _check_even(embeddings, loss, layout):
    shape = tuple(embeddings.shape)
    width = shape[-1] if shape else None
    if len(shape) != 2 or (width is not None and width % 2):
        raise ValueError(
            f"`{loss}` expects `y_pred` of shape (batch, 2 * dim), laid out as "
            f"{layout}. Received: y_pred of shape {shape}")


def _snake(name):
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def _flatten(structure):
    if isinstance(structure, dict):
        return [leaf for value in structure.values() for leaf in _flatten(value)]
    if isinstance(structure, (list, tuple)):
        return [leaf for value in structure for leaf in _flatten(value)]
    return [structure]


def window_loss_of(model):
    """The `WindowLoss` `model` is compiled with, or `None`.

    Read from `model.loss`, what `compile` received (both Keras versions).
    """
    found = [loss for loss in _flatten(getattr(model, "loss", None))
             if isinstance(loss, WindowLoss)]
    return found[0] if found else None


def check_meets(model, loss, configuration, *, keras_step, keras_compute_loss,
                compiled_metrics, batch_norm):
    """Refuses, by name, what a window-wide loss cannot meet on any backend.

    Args:
        model: The compiled model; `loss`, its `WindowLoss`.
        configuration: The hook's `Configuration` (its reduction,
            accumulators, observers).
        keras_step: Whether the model keeps Keras' own `train_step`.
        keras_compute_loss: Whether it keeps Keras' own `compute_loss`.
        compiled_metrics: Whether it was compiled with `metrics=`.
        batch_norm: The names of its batch normalization layers.

    Everything accepted is exact: the window's update is the large batch's.
    """
    def refuse(what, why, fix):  # each backend's checks raise alike (docs/refusals.md)
        raise ValueError(
            f"Model {model.name!r} is compiled with the window-wide loss {loss!r}, "
            f"which cannot meet {what}: {why}. {fix}")

    if not keras_step:
        refuse("a `train_step` of its own",
               "the window's loss is computed by tfaccum's step, which runs Keras' "
               "forward pass and compiled loss itself", "Use Keras' own `train_step`.")
    if not keras_compute_loss:
        refuse("a `compute_loss` of its own", "the window's loss is computed from the "
               "window's outputs alone, without the inputs", "Use Keras' own `compute_loss`.")
    if compiled_metrics:
        refuse("compiled `metrics=`", "metrics of the window's outputs are not computed "
               "yet (the loss is reported, as the large batch's)",
               "Compile without metrics and evaluate with `model.evaluate()` or a "
               "callback.")
    if batch_norm:
        refuse(f"batch normalization (layers {batch_norm})",
               "each micro-batch's forward pass would run twice, with its own batch "
               "statistics", "Use LayerNormalization in the towers.")
    if configuration.reduction != Auto():
        refuse(f"reduction={configuration.reduction!r}", "the loss itself averages over the "
               "window, as over the large batch", "Leave reduction=\"auto\".")
    if configuration.skip_nonfinite:
        refuse("skip_nonfinite=True", "a non-finite window cannot be told apart by "
               "micro-batch; under a LossScaleOptimizer the optimizer itself skips a "
               "non-finite update, as for the large batch", "Leave skip_nonfinite=None.")
    if configuration.accumulator_dtype != "float32":
        refuse(f"accumulator_dtype={configuration.accumulator_dtype!r}", "not measured yet",
               "Use accumulator_dtype=\"float32\".")
    if any(observer.reads_micro_batch_gradients for observer in configuration.observers):
        refuse("noise_scale=True", "the noise scale compares micro-batch gradients with "
               "the window's, and a window-wide loss has no gradient of its own per "
               "micro-batch", "Pass noise_scale=None (off for window-wide losses).")
