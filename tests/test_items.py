"""Token-exact accumulation: masked and padded sequence losses equal the large batch.

Keras divides a masked loss by its unmasked elements, a micro-batch's by its
own; the large batch divides once by the window's total. Under
`reduction="auto"` (the default) each micro-batch is weighted by that count.
Every test here also checks that sample weighting alone is measurably off.
"""

import collections
import contextlib
import functools
import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

import reference as oracle
from reference import OPTIMIZERS
from reference import keras
from reference import max_diff
from reference import not_on_torch

import tfaccum
from reference import ops
from tfaccum import GradientAccumulationCallback
from tfaccum import reduction

TOL = 1e-5
N, T, VOCAB, CLASSES = 50, 10, 20, 5  # 13 micro-batches of 4: the last holds 2
MICRO, STEPS = 4, 4


def sequences(seed=0):
    """Sequences of lengths 1..T, zero-padded, with per-token labels."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, N)
    padding = np.arange(T)[None, :] >= lengths[:, None]
    tokens = rng.integers(1, VOCAB, (N, T))
    tokens[padding] = 0
    labels = rng.integers(0, CLASSES, (N, T))
    ignored = labels.copy()
    ignored[padding] = -100
    return tokens, labels, ignored, padding


def sequence_model(optimizer="sgd", mask_zero=True, ignore_class=None, masking=False,
                   seed=0, **compile_kwargs):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((T,), dtype="int32")
    if masking:  # a Masking layer on one-hot features instead of an embedding mask
        inputs = keras.Input((T, VOCAB))
        hidden = keras.layers.Masking(0.0)(inputs)
    else:
        hidden = keras.layers.Embedding(VOCAB, 8, mask_zero=mask_zero)(inputs)
    # Per token, keeping the mask (a recurrent layer would too, only slower).
    hidden = keras.layers.Dense(8, activation="tanh")(hidden)
    outputs = keras.layers.Dense(CLASSES)(hidden)
    model = keras.Model(inputs, outputs)
    factory = OPTIMIZERS[optimizer] if isinstance(optimizer, str) else optimizer
    model.compile(
        optimizer=factory(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=ignore_class),
        **compile_kwargs,
    )
    return model


def compare(build, x, y, epochs=2, sample_weight=None, callback_kwargs=None, **fit_kwargs):
    """Largest weight difference to the large batch after every update, per reduction.

    The large batch is trained once; both reductions are compared with it.
    """
    callback_kwargs = callback_kwargs or {}
    pair = oracle.compare(
        build, x, y, micro=MICRO, steps=STEPS, epochs=epochs, sample_weight=sample_weight,
        callback_kwargs=dict(reduction="auto", **callback_kwargs), **fit_kwargs)
    by_samples = GradientAccumulationCallback(
        accumulation_steps=STEPS, reduction="samples", **callback_kwargs)
    ours, _ = oracle.fit_accumulated(
        build(), x, y, micro=MICRO, steps=STEPS, epochs=epochs, callback=by_samples,
        sample_weight=sample_weight, **fit_kwargs)
    # After each update: micro-batches 4, 8, 12 and the flushed 13th of an epoch.
    assert len(pair.ours) == len(ours) == 4 * epochs
    return {"auto": pair.diff, "auto-callback": pair.callback,
            "samples": oracle.largest_update_diff(ours, pair.theirs),
            "samples-callback": by_samples}


# Plain SGD and Adam are in the tests below (ignore_class, masking, weights,
# partial windows, steps_per_execution).
# On tf_keras one optimizer each (the core re-checks; see conftest's `once`).
@pytest.mark.parametrize("optimizer", [pytest.param("sgd_momentum", marks=pytest.mark.once),
                                       "adamw_clipnorm"])
def test_embedding_mask_step_for_step(optimizer):
    tokens, labels, _, _ = sequences()
    results = compare(lambda: sequence_model(optimizer), tokens, labels)
    assert results["auto"] < TOL
    assert results["samples"] > 1e-3  # weighting by samples is not the large batch


def test_ignore_class():
    tokens, _, ignored, _ = sequences()
    results = compare(lambda: sequence_model(mask_zero=False, ignore_class=-100), tokens, ignored)
    assert results["auto"] < TOL and results["samples"] > 1e-3
    assert results["auto-callback"].items == 2 * int((ignored != -100).sum())  # 2 epochs


@pytest.mark.once
def test_masking_layer():
    tokens, labels, _, _ = sequences()
    one_hot = np.eye(VOCAB, dtype="float32")[tokens] * (tokens > 0)[..., None]
    results = compare(lambda: sequence_model(masking=True), one_hot, labels)
    assert results["auto"] < TOL and results["samples"] > 1e-3


@pytest.mark.once
def test_mask_with_sample_weight():
    tokens, labels, _, _ = sequences()
    # Per-token weights (Keras takes [samples, tokens] weights for sequences).
    weights = np.repeat(np.linspace(0.2, 2.0, N)[:, None], T, axis=1).astype("float32")
    results = compare(lambda: sequence_model("adam"), tokens, labels, sample_weight=weights)
    assert results["auto"] < TOL and results["samples"] > 1e-3


@pytest.mark.once
def test_mask_and_ignore_class_together_with_per_token_weights():
    tokens, _, ignored, padding = sequences()
    ignored[:, 0] = np.where(np.arange(N) % 3 == 0, -100, ignored[:, 0])  # more ignored
    weights = np.where(padding, 0.0, 1.0 + (np.arange(T) % 2)).astype("float32")
    results = compare(lambda: sequence_model("adam", ignore_class=-100), tokens, ignored,
                      sample_weight=weights)
    assert results["auto"] < TOL and results["samples"] > 1e-3


@pytest.mark.once
@not_on_torch("jit_compile")
def test_jit_compile():
    # SGD with momentum: under XLA the embedding's window is dense (sparse
    # rows need varying shapes), which Adam would apply differently. Sparse
    # rows are TensorFlow's: only there does XLA make them dense.
    tokens, labels, _, _ = sequences()
    dense = (pytest.warns(UserWarning, match="accumulated densely under jit_compile")
             if oracle.BACKEND == "tensorflow" else contextlib.nullcontext())
    with dense:
        results = compare(lambda: sequence_model("sgd_momentum", jit_compile=True), tokens, labels)
    assert results["auto"] < TOL and results["samples"] > 1e-3


@not_on_torch("steps_per_execution")
def test_steps_per_execution():
    tokens, labels, _, _ = sequences()
    results = compare(lambda: sequence_model("adam", steps_per_execution=3), tokens, labels)
    assert results["auto"] < TOL and results["samples"] > 1e-3


@pytest.mark.parametrize("kind", ["partial", pytest.param("lambda", marks=pytest.mark.once)])
def test_a_loss_given_as_a_function(kind):
    # Keras wraps a function in a loss of its own; its mask is counted as
    # Keras' own loss's (and its config, which a partial cannot give, is not
    # asked for).
    tokens, labels, _, _ = sequences()
    function = functools.partial(keras.losses.sparse_categorical_crossentropy, from_logits=True)
    if kind == "lambda":
        function = lambda y, p: keras.losses.sparse_categorical_crossentropy(  # noqa: E731
            y, p, from_logits=True)

    def build():
        model = sequence_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=function)
        return model

    results = compare(build, tokens, labels)
    assert results["auto"] < TOL and results["samples"] > 1e-3


@pytest.mark.parametrize("leftover", ["carry", "drop"])
def test_partial_windows(leftover):
    tokens, labels, _, _ = sequences()
    pair = oracle.compare(lambda: sequence_model("adam"), tokens, labels, micro=MICRO,
                          steps=STEPS, epochs=2, leftover=leftover)
    assert pair.diff < TOL
    assert pair.callback.optimizer_steps == len(pair.updates) == (7 if leftover == "carry" else 6)


def test_window_items_are_counted(capsys):
    tokens, labels, _, padding = sequences()
    model = sequence_model()
    callback = GradientAccumulationCallback(accumulation_steps=13, verbose=1)
    model.fit(tokens, labels, batch_size=MICRO, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert callback.hook.counts.numpy()["window_items"] == 0  # applied
    assert callback.items == int((~padding).sum())  # tokens trained on in this fit
    assert f"{int((~padding).sum())} items" in capsys.readouterr().out


class TokenMeanLoss(keras.losses.Loss):
    """A custom token-averaged loss: labels of -1 do not count."""

    def __init__(self, counted=True):
        super().__init__(reduction="sum")  # it returns its own mean
        self.counted = counted

    def call(self, y_true, y_pred):
        valid = ops.cast(y_true >= 0, "float32")
        per_token = keras.losses.sparse_categorical_crossentropy(
            ops.maximum(y_true, 0), y_pred, from_logits=True) * valid
        items = ops.sum(valid)
        if self.counted:
            items = tfaccum.count_items(items)
        return ops.sum(per_token) / items


@pytest.mark.parametrize("counted", [
    pytest.param(True, id="count_items"),
    pytest.param(False, id="without", marks=pytest.mark.once)])
def test_custom_loss_says_what_it_averages_over(counted):
    tokens, _, ignored, _ = sequences()
    ignored[ignored == -100] = -1

    def build():
        model = sequence_model(mask_zero=False)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=TokenMeanLoss(counted))
        return model

    results = compare(build, tokens, ignored)
    if counted:
        assert results["auto"] < TOL
        assert results["auto-callback"].items == 2 * int((ignored >= 0).sum())  # 2 epochs
    else:
        # A loss that divides by its own count without saying so is weighted
        # by samples: measurably not the large batch (and warned about).
        assert results["auto"] > 1e-3


# (loss, labels, per-token weights): whether every micro-batch with a sample counts an item
COUNT_CASES = {
    "per-token": (dict(mask_zero=False), "labels", False, True),
    "per-token-weights": (dict(mask_zero=False), "labels", True, True),
    "mask": (dict(mask_zero=True), "labels", False, False),
    "ignore_class": (dict(mask_zero=False, ignore_class=-100), "ignored", False, False),
    "count_items": (None, "ignored", False, False),
}


@pytest.mark.backend("tensorflow", reason="spies on what TensorFlow's step traces (its "
                     "graph's size); the exactness of each case on JAX is "
                     "test_custom_loss_says_what_it_averages_over's, test_ignore_class's and "
                     "test_embedding_mask_step_for_step's")
@pytest.mark.parametrize("case", list(COUNT_CASES))
def test_only_a_count_that_may_be_zero_is_asked_whether_it_counted(case, monkeypatch):
    """A loss over a fixed number of elements per sample counts some in every
    micro-batch that holds a sample: its step traces neither the branch that
    empties a window of micro-batches that counted nothing nor the weighting of
    such a micro-batch, and weighs each by its items. A mask, `ignore_class`
    and `count_items()` may count 0 and keep both. Each the large batch."""
    model_kwargs, labels, weighted, every_sample_counts = COUNT_CASES[case]
    tokens, plain, ignored, padding = sequences()
    y = plain if labels == "labels" else ignored
    if case == "count_items":
        y = np.where(ignored == -100, -1, ignored)

        def build():
            model = sequence_model(mask_zero=False)
            model.compile(optimizer=keras.optimizers.SGD(0.5), loss=TokenMeanLoss(True))
            return model
    else:
        def build():
            return sequence_model(**model_kwargs)
    from tfaccum.backend.tensorflow import window

    traced = collections.Counter()
    for owner, name in ((window.WindowState, "_forget_uncounted"), (reduction.Auto, "weight")):
        def spy(*args, _original=getattr(owner, name), _name=name, **kwargs):
            traced[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, name, spy)
    pair = oracle.compare(build, tokens, y, micro=MICRO, steps=STEPS, epochs=1,
                          sample_weight=(~padding).astype("float32") if weighted else None)
    assert pair.diff < TOL
    if every_sample_counts:
        assert traced == {}, traced
    else:
        assert traced["_forget_uncounted"] > 0 and traced["weight"] > 0, traced


def two_heads(optimizer="sgd", seed=0, **compile_kwargs):
    """A per-token head (masked: counts tokens) and a per-sequence head (counts
    sequences), with loss weights and a regularised layer."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((T,), dtype="int32")
    hidden = keras.layers.Dense(8, activation="tanh")(
        keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs))
    per_token = keras.layers.Dense(CLASSES, name="per_token",
                                   kernel_regularizer=keras.regularizers.L2(1e-2))(hidden)
    per_sequence = keras.layers.Dense(1, name="per_sequence")(
        keras.layers.GlobalAveragePooling1D()(hidden))
    model = keras.Model(inputs, {"per_token": per_token, "per_sequence": per_sequence})
    model.compile(optimizer=OPTIMIZERS[optimizer]() if isinstance(optimizer, str) else optimizer,
                  loss={
        "per_token": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "per_sequence": "mse"}, loss_weights={"per_token": 1.0, "per_sequence": 0.5},
        **compile_kwargs)
    return model


@pytest.mark.parametrize("optimizer", [pytest.param("sgd_momentum", marks=pytest.mark.once),
                                       "adamw_clipnorm"])
def test_several_differently_masked_outputs_step_for_step(optimizer):
    tokens, labels, _, _ = sequences()
    y = {"per_token": labels, "per_sequence": labels.mean(axis=1, keepdims=True)}
    with warnings.catch_warnings():
        # Exact: tfaccum warns about nothing (NumPy's DeprecationWarning on
        # reading a JAX variable in the oracle aside).
        warnings.simplefilter("error", UserWarning)
        results = compare(lambda: two_heads(optimizer), tokens, y)
    assert results["auto"] < TOL
    assert results["samples"] > 1e-3  # one weight per micro-batch cannot be the large batch
    assert results["auto-callback"].optimizer_steps == 8


MIRRORED = ("two MirroredStrategy replicas; JAX's DataParallel over devices that count "
            "different tokens: test_jax.py::test_data_parallel_counts_each_devices_tokens")


@pytest.mark.backend("tensorflow", reason=MIRRORED)
@pytest.mark.once
def test_mirrored_replicas_with_different_token_counts():
    from reference import mirrored

    tokens, labels, _, padding = sequences()
    # Each replica gets half of each micro-batch of 4: their token counts differ.
    halves = (~padding[:48]).reshape(-1, 2, 2, T).sum(axis=(2, 3))
    assert (halves[:, 0] != halves[:, 1]).sum() >= 10
    # SGD with momentum: with several replicas the embedding's window is
    # dense (refused for rows), which Adam would apply differently.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the embedding's dense window on replicas
        pair = oracle.compare(lambda: sequence_model("sgd_momentum"), tokens, labels,
                              micro=MICRO, steps=STEPS, epochs=2, strategy=mirrored())
    assert pair.diff < TOL


@pytest.mark.backend("tensorflow", reason=MIRRORED)
@pytest.mark.once
def test_several_differently_masked_outputs_on_mirrored_replicas(tmp_path):
    # Each output's accumulator per replica; each output's total over both
    # replicas at the window's end (with the counts, no extra collective).
    from reference import mirrored
    from reference import read_run
    from test_summary import values

    tokens, labels, _, _ = sequences()
    y = {"per_token": labels, "per_sequence": labels.mean(axis=1, keepdims=True)}
    reference = two_heads("sgd_momentum")
    large = [reference.train_on_batch(tokens[s:s + MICRO * STEPS],
                                      {k: v[s:s + MICRO * STEPS] for k, v in y.items()},
                                      return_dict=True)["loss"]
             for _ in range(2) for s in range(0, N, MICRO * STEPS)]
    strategy = mirrored()
    with strategy.scope():
        model = two_heads("sgd_momentum")
    log_dir = str(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the embedding's dense window
        model.fit(tokens, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0, callbacks=[
            GradientAccumulationCallback(accumulation_steps=STEPS, log_dir=log_dir)])
    assert max_diff(model.get_weights(), reference.get_weights()) < TOL
    np.testing.assert_allclose(values(read_run(log_dir)[0], "window_loss"), large, rtol=1e-5)


@pytest.mark.parametrize("heads", [
    pytest.param(1, id="one-output", marks=pytest.mark.once),
    pytest.param(2, id="two-outputs")])
def test_the_window_loss_is_the_large_batch_loss(tmp_path, heads):
    """Recorded per update: the loss the large batch reports, point for point."""
    from reference import read_run
    from test_summary import values

    tokens, labels, _, padding = sequences()
    if heads == 1:
        build, y = (lambda: sequence_model("adam")), labels
    else:  # each output's loss over its own count, plus regularization
        build = lambda: two_heads("adam")  # noqa: E731
        y = {"per_token": labels, "per_sequence": labels.mean(axis=1, keepdims=True)}

    def window(start):
        return (y[start:start + 16] if heads == 1
                else {k: v[start:start + 16] for k, v in y.items()})

    reference = build()
    large = []
    for start in range(0, N, MICRO * STEPS):  # one epoch of large batches
        logs = reference.train_on_batch(tokens[start:start + 16], window(start), return_dict=True)
        large.append(logs["loss"])
    log_dir = str(tmp_path / "run")
    model = build()
    model.fit(tokens, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0, callbacks=[
        GradientAccumulationCallback(accumulation_steps=STEPS, log_dir=log_dir)])
    series, _ = read_run(log_dir)
    np.testing.assert_allclose(values(series, "window_loss"), large, rtol=1e-5)
    assert values(series, "window_samples") == [16, 16, 16, 2]
    if heads == 1:  # items per update beside samples: the window's unmasked tokens
        tokens_per_window = [int((~padding[s:s + 16]).sum()) for s in range(0, N, 16)]
        assert values(series, "window_items") == tokens_per_window


@pytest.mark.once
def test_mask_with_class_weight():
    """A masked sequence classifier (the mask stops at the pooling) with class_weight."""
    tokens, labels, _, _ = sequences()
    classes = labels[:, 0]

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((T,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 8, mask_zero=True),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(CLASSES),
        ])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    class_weight = {c: 0.5 + c for c in range(CLASSES)}
    results = compare(build, tokens, classes, class_weight=class_weight)
    assert results["auto"] < TOL


def test_a_loss_that_returns_a_python_number():
    """As Keras' own ragged tests do (a model without weights): counted as one element."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Rescaling(2.0)])
    model.compile(optimizer="sgd", loss=lambda y_true, y_pred: 0)
    x = np.ones((8, 3), "float32")
    callback = GradientAccumulationCallback(accumulation_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras: nothing to train
        model.fit(x, x, batch_size=2, epochs=1, verbose=0, callbacks=[callback])
    assert callback.micro_steps == 4


@pytest.mark.parametrize("items, error, received", [
    (True, TypeError, "True"),
    (None, TypeError, "None"),
    ("4", TypeError, "'4'"),
    ([1, 2], TypeError, "[1, 2]"),
    (-4, ValueError, "-4"),
    (2.5, ValueError, "2.5"),
    (0.4, ValueError, "0.4"),
    (float("nan"), ValueError, "nan"),
    (float("inf"), ValueError, "inf"),
    (1e30, ValueError, "1e+30"),
    (2**62, ValueError, str(2**62)),
    (np.float32(2.5), ValueError, "np.float32(2.5)"),
])
def test_count_items_refuses_what_is_no_count(items, error, received):
    with pytest.raises(error, match=r"`count_items\(\)`.*Received: items=" + re.escape(received)):
        tfaccum.count_items(items)


@pytest.mark.parametrize("items", [0, 7, 7.0, np.int32(7), 2**40])
def test_count_items_takes_whole_numbers(items):
    assert tfaccum.count_items(items) is items


class CountedBy(keras.losses.Loss):
    """A token mean loss that tells `count_items` what `count(valid)` says."""

    def __init__(self, count, twice=False):
        super().__init__(reduction="sum")
        self.count, self.twice = count, twice

    def call(self, y_true, y_pred):
        valid = ops.cast(y_true >= 0, "float32")
        per_token = keras.losses.sparse_categorical_crossentropy(
            ops.maximum(y_true, 0), y_pred, from_logits=True) * valid
        items = tfaccum.count_items(self.count(ops.sum(valid)))
        if self.twice:
            tfaccum.count_items(items)
        return ops.divide_no_nan(ops.sum(per_token), ops.cast(items, "float32"))


def fit_counted(count, twice=False):
    tokens, _, ignored, _ = sequences()
    model = sequence_model(mask_zero=False)
    model.compile(optimizer="sgd", loss=CountedBy(count, twice))
    model.fit(tokens, ignored, batch_size=MICRO, epochs=1, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=STEPS)])
    return model


@pytest.mark.once
@pytest.mark.parametrize("count, message", [
    (lambda n: n - 1000.0, "a count >= 0"),
    (lambda n: n + 0.5, "a whole number"),
    (lambda n: n / 0.0, "finite"),
    (lambda n: n * 1e30, "at most"),
])
def test_count_items_refuses_bad_counts_at_run_time(count, message):
    # TensorFlow's assertion fails the step; JAX's host reads the count and refuses it.
    failure = tf.errors.InvalidArgumentError if oracle.BACKEND == "tensorflow" else ValueError
    with pytest.raises(failure, match=f"count_items.*{message}"):
        fit_counted(count)
    model = fit_counted(lambda n: n)  # the model was left plain, and trains
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


@pytest.mark.parametrize("count, error, message", [
    (lambda n: ops.stack([n, n]), ValueError, "a scalar"),
    pytest.param(lambda n: tf.strings.as_string(n), TypeError, "a number",
                 marks=pytest.mark.backend("tensorflow", reason="a string tensor is "
                                           "TensorFlow's (a boolean is the next case)")),
    (lambda n: n > 0, TypeError, "a number"),
])
def test_count_items_refuses_what_is_no_count_while_tracing(count, error, message):
    with pytest.raises(error, match=f"count_items.*{message}"):
        fit_counted(count)


def test_count_items_once_per_step():
    with pytest.raises(ValueError, match=r"count_items\(\)` was called 2 times in one step; "
                       r"the window weights each micro-batch by one count"):
        fit_counted(lambda n: n, twice=True)
