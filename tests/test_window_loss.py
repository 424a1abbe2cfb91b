"""The window-wide losses as losses: values against NumPy, arguments refused by name."""

import numpy as np
import pytest
from keras import ops

import tfaccum
from reference import keras

# Written in keras.ops: the same losses on every backend.
pytestmark = pytest.mark.once


def _normalize(a):
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


def _cross_entropy(logits, labels):
    logits = logits - logits.max(axis=1, keepdims=True)
    log_softmax = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -log_softmax[np.arange(len(labels)), labels]


def _pairs(n=6, dim=4, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 2 * dim)).astype("float32")


def test_in_batch_softmax_scores_each_query_against_every_document():
    y_pred = _pairs()
    q, d = _normalize(y_pred[:, :4]), _normalize(y_pred[:, 4:])
    similarity = q @ d.T
    forward = _cross_entropy(similarity / 0.1, np.arange(6))
    backward = _cross_entropy(similarity.T / 0.1, np.arange(6))
    one_way = tfaccum.InBatchSoftmax(temperature=0.1)(None, y_pred)
    both = tfaccum.InBatchSoftmax(temperature=0.1, symmetric=True)(None, y_pred)
    np.testing.assert_allclose(one_way, forward, rtol=1e-5)
    np.testing.assert_allclose(both, (forward + backward) / 2, rtol=1e-5)
    raw = tfaccum.InBatchSoftmax(temperature=1.0, normalize=False)(None, y_pred)
    np.testing.assert_allclose(raw, _cross_entropy(y_pred[:, :4] @ y_pred[:, 4:].T,
                                                   np.arange(6)), rtol=1e-5)


def test_a_learned_temperature_is_read_from_the_last_column():
    y_pred = _pairs()
    log_scale = np.full((6, 1), np.log(20.0), "float32")
    learned = tfaccum.InBatchSoftmax(temperature="learned", symmetric=True)(
        None, np.concatenate([y_pred, log_scale], axis=1))
    fixed = tfaccum.InBatchSoftmax(temperature=0.05, symmetric=True)(None, y_pred)
    np.testing.assert_allclose(learned, fixed, rtol=1e-5)


def test_nt_xent_pairs_each_view_with_the_other():
    y_pred = _pairs(n=5, dim=3)
    views = _normalize(np.concatenate([y_pred[:, :3], y_pred[:, 3:]], axis=0))
    logits = views @ views.T / 0.5
    np.fill_diagonal(logits, -np.inf)
    losses = _cross_entropy(np.where(np.isinf(logits), -1e9, logits),
                            np.concatenate([np.arange(5, 10), np.arange(5)]))
    np.testing.assert_allclose(tfaccum.NTXent(temperature=0.5)(None, y_pred),
                               (losses[:5] + losses[5:]) / 2, rtol=1e-5)


def test_a_window_loss_is_an_ordinary_loss_without_the_callback():
    def in_batch(y_true, y_pred):
        q, d = ops.split(y_pred, 2, axis=-1)
        logits = ops.matmul(q, ops.transpose(d))
        return ops.sparse_categorical_crossentropy(ops.arange(ops.shape(q)[0]), logits,
                                                   from_logits=True)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    model.compile("sgd", loss=tfaccum.WindowLoss(in_batch))
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    loss = model.evaluate(x, np.zeros(8), batch_size=8, verbose=0)
    np.testing.assert_allclose(loss, np.mean(ops.convert_to_numpy(in_batch(None, model(x)))), rtol=1e-5)
    assert repr(tfaccum.WindowLoss(in_batch)) == "WindowLoss(name='in_batch')"


@pytest.mark.parametrize("make, message", [
    (lambda: tfaccum.InBatchSoftmax(temperature=0),
     r"`temperature` must be a float > 0 .*Received: temperature=0"),
    (lambda: tfaccum.InBatchSoftmax(temperature="hot"),
     r"Received: temperature='hot'"),
    (lambda: tfaccum.NTXent(temperature=float("nan")), r"Received: temperature=nan"),
    (lambda: tfaccum.WindowLoss("in_batch"), r"`fn` must be a callable .*Received: fn='in_batch'"),
    (lambda: tfaccum.WindowLoss(), r"`WindowLoss` needs `fn`.*Received: fn=None"),
    (lambda: tfaccum.InBatchSoftmax()(None, np.zeros((4, 5), "float32")),
     r"`InBatchSoftmax` expects `y_pred` of shape \(batch, 2 \* dim\).*Received: y_pred of "
     r"shape \(4, 5\)"),
])
def test_bad_arguments_are_refused_by_name(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()
