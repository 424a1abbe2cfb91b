"""Degenerate windows train as the large batch: nothing masked in, nothing to divide by.

A micro-batch whose every token is masked averages its loss over nothing:
Keras makes that loss 0 (its gradient is the regularisers' alone). A window
of such micro-batches must then apply what the large batch applies (the
regularisers' gradient, or nothing), never 0/0.
"""

import numpy as np
import pytest

from reference import all_finite
from reference import fit_accumulated
from reference import keras
from reference import largest_update_diff
from reference import train_large_batches
from reference import windows
from reference import read_run
from test_summary import values

import reference as oracle
import tfaccum

TOL = 1e-5
T, VOCAB, CLASSES = 6, 10, 5


def token_model(optimizer="sgd", regularizer=None):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((T,), dtype="int32"),
        keras.layers.Embedding(VOCAB, 4, mask_zero=True),
        keras.layers.Dense(CLASSES, kernel_regularizer=regularizer),
    ])
    optimizers = {
        "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01),
    }
    model.compile(optimizer=optimizers[optimizer](),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def tokens(n, masked_micro_batches=(), micro=4, seed=0):
    """Sequences of 1..T tokens; the listed micro-batches are all padding."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, n)
    x = rng.integers(1, VOCAB, (n, T)).astype("int32")
    x[np.arange(T)[None, :] >= lengths[:, None]] = 0
    for index in masked_micro_batches:
        x[index * micro:(index + 1) * micro] = 0
    return x, rng.integers(0, CLASSES, (n, T))


def compare(build, x, y, micro=4, steps=4, epochs=1, **callback_kwargs):
    ours, callback = fit_accumulated(
        build(), x, y, micro=micro, steps=steps, epochs=epochs,
        callback=tfaccum.GradientAccumulationCallback(accumulation_steps=steps, **callback_kwargs))
    theirs = train_large_batches(build(), x, y, windows(len(x), micro, steps, epochs))
    assert all(all_finite(w) for w in ours), "NaN or inf in the accumulated weights"
    return largest_update_diff(ours, theirs), callback


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("regularizer", [None, "l2"])
def test_a_fully_masked_window_is_the_large_batch(optimizer, regularizer):
    x, y = tokens(32, masked_micro_batches=range(4))  # the first window: all padding
    diff, callback = compare(lambda: token_model(optimizer, regularizer), x, y)
    assert diff < TOL
    assert callback.optimizer_steps == 2 and callback.samples == 32


def test_a_fully_masked_partial_window_flushed_at_the_epoch_end():
    x, y = tokens(22, masked_micro_batches=(4, 5))  # 6 micro-batches: the last 2 flushed
    diff, callback = compare(lambda: token_model("adam", "l2"), x, y, epochs=2)
    assert diff < TOL
    assert callback.flushes == 2
    assert callback.items == 2 * int(np.sum(x != 0))  # the masked micro-batches count none


def test_masked_micro_batches_before_and_after_unmasked_ones():
    # Window 1: masked, masked, unmasked, masked; window 2: unmasked then masked.
    x, y = tokens(32, masked_micro_batches=(0, 1, 3, 5, 6, 7))
    diff, _ = compare(lambda: token_model("adam", "l2"), x, y)
    assert diff < TOL


def test_the_model_trains_plainly_afterwards():
    x, y = tokens(16, masked_micro_batches=range(4))
    model = token_model("adam")
    fit_accumulated(model, x, y, micro=4, steps=4)
    model.fit(*tokens(16), batch_size=4, verbose=0)
    assert all_finite(model.get_weights())


def test_summaries_of_masked_micro_batches_are_finite(tmp_path):
    # A fully masked micro-batch inside a valid window, and a fully masked window.
    x, y = tokens(32, masked_micro_batches=(1, 4, 5, 6, 7))
    log_dir = str(tmp_path / "run")
    diff, callback = compare(lambda: token_model("sgd", "l2"), x, y, log_dir=log_dir,
                             noise_scale=True)
    assert diff < TOL
    series, _ = read_run(log_dir)
    for name in ("applied_gradient_norm", "micro_norm_mean", "micro_norm_max", "window_loss"):
        assert np.all(np.isfinite(values(series, name))), name
    assert values(series, "window_items")[1] == 0


@pytest.mark.backend("tensorflow", reason="two MirroredStrategy replicas; JAX's DataParallel "
                     "shares that count nothing: test_jax.py::test_data_parallel_counts_each_devices_tokens")
def test_two_replicas_whose_shares_count_nothing():
    import warnings

    from reference import mirrored

    # Micro-batches of 4, 2 per replica. Window 1 is all padding; in window 2
    # the first replica's shares are; in window 3 one micro-batch is.
    x, y = tokens(48, masked_micro_batches=(0, 1, 2, 3, 9))
    for index in range(4, 8):
        x[index * 4:index * 4 + 2] = 0
    build = lambda: token_model("sgd", "l2")  # noqa: E731 - SGD: dense rows on replicas
    theirs = train_large_batches(build(), x, y, windows(48, 4, 4))
    with mirrored().scope():
        model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the embedding's rows are dense on replicas
        ours, _ = fit_accumulated(model, x, y, micro=4, steps=4)
    assert all(all_finite(w) for w in ours)
    assert largest_update_diff(ours, theirs) < TOL


def test_a_one_sample_micro_batch_and_one_of_zero_weights():
    # 33 samples in micro-batches of 8: the last holds one sample; the
    # second's sample weights are all zero.
    x, y = oracle.make_data(n=33)
    weights = np.ones(33, "float32")
    weights[8:16] = 0.0

    def build():
        return oracle.make_model(optimizer="adam")

    result = oracle.compare(build, x, y, micro=8, steps=3, epochs=2, sample_weight=weights)
    assert result.diff < TOL
    assert result.moved(build) > 1e-2


def test_nan_in_one_micro_batch_spoils_its_window_as_it_spoils_the_large_batch():
    # Without skip_nonfinite the NaN reaches the update where the large
    # batch's does, and nowhere else. (Under DataParallel: test_jax.py.)
    x, y = oracle.make_data(n=48)
    x[29, 2] = np.nan  # the second window's second micro-batch

    def build():
        return oracle.make_model(optimizer="sgd")

    result = oracle.compare(build, x, y, micro=8, steps=3)
    assert len(result.ours) == len(result.theirs) == 2
    for ours, theirs in zip(result.ours, result.theirs):
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, equal_nan=True)
    assert all_finite(result.ours[0])
    assert not all_finite(result.ours[1])
