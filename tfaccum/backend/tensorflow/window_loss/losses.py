"""Window-wide losses: losses that couple the samples of a batch (in-batch negatives).

A loss such as a two-tower model's in-batch softmax scores each query against
every document of its batch. Accumulated micro-batch by micro-batch it would
see only its micro-batch's negatives; compiled as a `WindowLoss`, the
accumulation hook computes it over the whole window instead (gradient
caching, `gradient_cache` in this package), so a window of micro-batches trains
exactly as the large batch. Without the hook a `WindowLoss` is an ordinary
Keras loss over its batch.

A window loss maps `(y_true, y_pred)` of a whole batch to one loss per
sample, shape `(batch,)`; Keras averages it (with `sample_weight`) as it does
any loss.
"""

import math
import sys

import keras
import tensorflow as tf

from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.reduction import Auto


def _check_tensorflow_backend(loss):
    """Refuses a window-wide loss where Keras 3 does not run on TensorFlow (its ops
    are TensorFlow's: Keras would trace them with JAX's arrays and fail)."""
    backend = keras.backend.backend()
    if backend != "tensorflow" and "tf_keras" not in sys.modules:
        raise ValueError(
            f"tfaccum.{loss} runs on Keras' TensorFlow backend only, for now, but Keras "
            f"is running on its {backend!r} backend. Received: keras.backend.backend()="
            f"{backend!r}. Set KERAS_BACKEND=tensorflow before Keras is first imported, "
            "or compile with a loss of each micro-batch.")


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
            Subclasses implement `call()` instead.
        name: The loss's name. Defaults to `fn`'s (or the class's) name.

    Example:

    ```python
    def in_batch(y_true, y_pred):   # y_pred: [queries | documents]
        q, d = tf.split(y_pred, 2, axis=-1)
        logits = tf.matmul(q, d, transpose_b=True)
        labels = tf.range(tf.shape(logits)[0])
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)

    model.compile(optimizer="adam", loss=tfaccum.WindowLoss(in_batch), jit_compile=False)
    model.fit(x, y, batch_size=32, callbacks=[
        tfaccum.GradientAccumulationCallback(accumulation_steps=8)])  # 256 negatives
    ```
    """

    def __init__(self, fn=None, *, name=None):
        _check_tensorflow_backend(type(self).__name__)
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
    model.compile("adam", loss=tfaccum.InBatchSoftmax(temperature=0.05),
                  jit_compile=False)  # not XLA (Keras 3's "auto" on a GPU)
    ```
    """

    def __init__(self, temperature=0.05, *, symmetric=False, normalize=True, name=None):
        if temperature != "learned":
            _check_temperature(temperature)
        self.temperature = temperature
        self.symmetric = bool(symmetric)
        self.normalize = bool(normalize)
        super().__init__(name=name or "in_batch_softmax")

    def call(self, y_true, y_pred):
        y_pred = tf.convert_to_tensor(y_pred)
        if self.temperature == "learned":
            embeddings, log_scale = y_pred[:, :-1], y_pred[:, -1:]
            scale = tf.exp(tf.cast(log_scale, tf.float32))
        else:
            embeddings, scale = y_pred, 1.0 / self.temperature
        _check_even(embeddings, "InBatchSoftmax", "[query | document]")
        queries, documents = tf.split(tf.cast(embeddings, tf.float32), 2, axis=-1)
        if self.normalize:
            queries = tf.math.l2_normalize(queries, axis=-1)
            documents = tf.math.l2_normalize(documents, axis=-1)
        similarity = tf.matmul(queries, documents, transpose_b=True)
        labels = tf.range(tf.shape(similarity)[0])
        forward = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, similarity * scale)
        if not self.symmetric:
            return forward
        # Every row's scale is the same: one scale, whichever way it is read.
        backward = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels, tf.transpose(similarity) * scale)
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
    model.compile("adam", loss=tfaccum.NTXent(temperature=0.5), jit_compile=False)
    ```
    """

    def __init__(self, temperature=0.5, *, name=None):
        _check_temperature(temperature)
        self.temperature = float(temperature)
        super().__init__(name=name or "nt_xent")

    def call(self, y_true, y_pred):
        y_pred = tf.cast(tf.convert_to_tensor(y_pred), tf.float32)
        _check_even(y_pred, "NTXent", "[view 1 | view 2]")
        first, second = tf.split(y_pred, 2, axis=-1)
        views = tf.math.l2_normalize(tf.concat([first, second], axis=0), axis=-1)
        n = tf.shape(first)[0]
        logits = tf.matmul(views, views, transpose_b=True) / self.temperature
        logits -= tf.eye(2 * n) * 1e9  # a view is not its own negative
        labels = tf.concat([tf.range(n, 2 * n), tf.range(n)], axis=0)
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
        return (losses[:n] + losses[n:]) / 2.0

    def get_config(self):
        return {"temperature": self.temperature, "name": self.name}

    def __repr__(self):
        return f"NTXent(temperature={self.temperature!r})"


def _check_temperature(temperature):
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature) or temperature <= 0):
        raise ValueError(
            f"`temperature` must be a float > 0 (or \"learned\" for `InBatchSoftmax`). "
            f"Received: temperature={temperature!r}")


def _check_even(embeddings, loss, layout):
    width = embeddings.shape[-1]
    if embeddings.shape.rank != 2 or (width is not None and width % 2):
        raise ValueError(
            f"`{loss}` expects `y_pred` of shape (batch, 2 * dim), laid out as "
            f"{layout}. Received: y_pred of shape {embeddings.shape}")


def _snake(name):
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def window_loss_of(model):
    """The `WindowLoss` `model` is compiled with, or `None`.

    Read from `model.loss`, what `compile` received (both Keras versions).
    """
    losses = getattr(model, "loss", None)
    found = [loss for loss in tf.nest.flatten(losses) if isinstance(loss, WindowLoss)]
    return found[0] if found else None


def check_window_loss_meets(model, loss, configuration):
    """Refuses, by name, what a window-wide loss (gradient caching) cannot meet yet.

    `configuration`: the hook's `Configuration` (its reduction, accumulators,
    observers).

    Everything accepted is exact: the window's update is the large batch's.
    """
    def refuse(what, why, fix):
        raise ValueError(
            f"Model {model.name!r} is compiled with the window-wide loss {loss!r}, "
            f"which cannot meet {what}: {why}. {fix}")

    strategy = model.distribute_strategy
    replicas = strategy.num_replicas_in_sync
    if replicas > 1 and len(strategy.extended.worker_devices) < replicas:
        refuse(f"a strategy across several machines ({type(strategy).__name__})",
               "the window's outputs are gathered across one machine's replicas only",
               "Train it on one machine (MirroredStrategy), or compile with an ordinary loss.")
    api = _keras_on_tf.api_for(model)
    if replicas > 1 and not api.gathers_across_replicas:
        refuse(f"a tf_keras model under a strategy with {replicas} replicas",
               "gathering the window's outputs across replicas is built for Keras 3 only",
               "Use Keras 3, or one device.")
    if not _keras_on_tf.trains_with_keras_step(model):
        refuse("a `train_step` of its own",
               "the window's loss is computed by tfaccum's step, which runs Keras' "
               "forward pass and compiled loss itself", "Use Keras' own `train_step`.")
    if model.jit_compile:
        refuse("jit_compile=True (which Keras 3's default, \"auto\", picks on a GPU)",
               "the window's buffers grow with each micro-batch, which XLA's fixed shapes "
               "do not allow", "Compile with jit_compile=False.")
    if replicas > 1 and _keras_on_tf.may_hold_several_losses(model):
        refuse(f"several compiled losses under a strategy with {replicas} replicas",
               "the window's loss is taken whole and Keras' per-replica share undone for "
               "it as one averaged loss", "Compile one loss, or train on one device.")
    if not _keras_on_tf.computes_loss_as_keras(model):
        refuse("a `compute_loss` of its own", "the window's loss is computed from the "
               "window's outputs alone, without the inputs", "Use Keras' own `compute_loss`.")
    if _keras_on_tf.api_for(model).has_compiled_metrics(model):
        refuse("compiled `metrics=`", "metrics of the window's outputs are not computed "
               "yet (the loss is reported, as the large batch's)",
               "Compile without metrics and evaluate with `model.evaluate()` or a "
               "callback.")
    norms = [layer.name for layer in _keras_on_tf.flatten_layers(model)
             if any("BatchNormalization" in cls.__name__ for cls in type(layer).__mro__)]
    if norms:
        refuse(f"batch normalization (layers {norms})",
               "each micro-batch's forward pass would run twice, with its own batch "
               "statistics", "Use LayerNormalization in the towers.")
    random = _keras_on_tf.api_for(model).random_layers(model)
    if random:
        refuse(f"tf_keras layers that draw random numbers ({random})",
               "their masks cannot be drawn again for the second forward pass",
               "Use Keras 3 (its seed generators replay), or remove them.")
    if not api.caches_under_loss_scaling and _keras_on_tf.scales_loss_dynamically(model.optimizer):
        refuse("tf_keras' LossScaleOptimizer", "mixed precision is built for Keras 3 only",
               "Use Keras 3, or float32.")
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
