"""The transparency contract: at `accumulation_steps=1` the callback is plain Keras.

For each Keras feature below, `fit` with `GradientAccumulationCallback(
accumulation_steps=1)` ends with the weights and `optimizer.iterations` of
`fit` without it. The one deliberate departure (no phantom step on a dataset
of unknown length) is tested in test_callback.py.
"""


import numpy as np
import pytest
import tensorflow as tf

from reference import KERAS
from reference import fit_with_and_without
from reference import iterations
from reference import keras
from reference import make_data
from reference import max_weight_diff

from tfaccum import GradientAccumulationCallback

TOL = 1e-6


def fit_both(build, x, y=None, epochs=2, **fit):
    """Fits two identical models, the second with the callback at steps=1."""
    pair = fit_with_and_without(build, x, y, epochs=epochs, **fit)
    assert pair.diff < TOL  # update for update
    return pair.reference, pair.model, pair.callback


def assert_same(plain, ours):
    if plain.get_weights():
        assert max_weight_diff(plain, ours) < TOL
    assert iterations(ours) == iterations(plain)


def mlp(seed=1, optimizer=lambda: keras.optimizers.Adam(0.01), **compile_kwargs):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(7, activation="tanh"),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=optimizer(), loss="mse", **compile_kwargs)
    return model


def test_frozen_model():
    def build():
        model = mlp()
        model.trainable = False
        model.compile(optimizer="adam", loss="mse")
        return model

    x, y = make_data()
    plain, ours, callback = fit_both(build, x, y, batch_size=8)
    assert_same(plain, ours)
    assert int(ours.optimizer.iterations) == 0
    assert callback.micro_steps == 13 * 2 and callback.optimizer_steps == 0


def test_model_without_weights():
    def build():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Activation("tanh")])
        model.compile(optimizer="sgd", loss="mse")
        return model

    x, _ = make_data()
    plain, ours, callback = fit_both(build, x, np.zeros_like(x), batch_size=8)
    assert_same(plain, ours)
    assert callback.micro_steps == 26


def test_training_argument():
    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([
            keras.Input((5,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.5, seed=3),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    x, y = make_data()
    assert_same(*fit_both(build, x, y, batch_size=8)[:2])


@pytest.mark.keras3  # tf_keras' Input(sparse=True) feeds differently
@pytest.mark.backend("tensorflow", "jax", reason="Keras' torch backend has no sparse inputs "
                     "(its Input(sparse=True) raises, with or without tfaccum)")
def test_sparse_inputs():
    x, y = make_data()
    x[x < 0.5] = 0.0
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.sparse.from_dense(x), y)).batch(8)

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,), sparse=True), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    assert_same(*fit_both(build, dataset)[:2])


class RaggedMean(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(tf.reduce_mean(x, axis=1))


@pytest.mark.backend("tensorflow", reason="tf.RaggedTensor inputs")
def test_ragged_inputs():
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=(int(n), 3)).astype("float32") for n in rng.integers(1, 6, 40)]
    ragged = tf.ragged.constant(rows, ragged_rank=1)
    y = rng.normal(size=(40, 1)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((ragged, y)).batch(8)

    def build():
        keras.utils.set_random_seed(1)
        model = RaggedMean()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    assert_same(*fit_both(build, dataset)[:2])


class SummaryLayer(keras.layers.Layer):
    def call(self, x):
        tf.summary.scalar("custom/mean", tf.reduce_mean(x))
        return x


@pytest.mark.backend("tensorflow", reason="tf.summary written from a layer's call")
def test_custom_summaries(tmp_path):
    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), SummaryLayer(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    x, y = make_data()
    runs = {}
    for name in ("plain", "ours"):
        runs[name] = keras.callbacks.TensorBoard(str(tmp_path / name), update_freq=1)
    plain = build()
    plain.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[runs["plain"]])
    ours = build()
    ours.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[
        GradientAccumulationCallback(accumulation_steps=1), runs["ours"]])
    assert_same(plain, ours)

    def custom_steps(log_dir):
        from tensorboard.backend.event_processing import event_accumulator

        accumulator = event_accumulator.EventAccumulator(
            str(log_dir / "train"), size_guidance={event_accumulator.TENSORS: 0})
        accumulator.Reload()
        (tag,) = [t for t in accumulator.Tags()["tensors"] if t.endswith("custom/mean")]
        return [e.step for e in accumulator.Tensors(tag)]

    assert custom_steps(tmp_path / "ours") == custom_steps(tmp_path / "plain") != []


def test_loss_scale_optimizer(mixed_precision):
    """Keras' default initial scale overflows this model's first steps: both skip them."""
    x, y = make_data()
    plain, ours, callback = fit_both(mlp, x, y, batch_size=8)
    if KERAS == "keras3":
        assert isinstance(ours.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_same(plain, ours)


def embedding_model(optimizer, seed=2):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(20, 4),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=optimizer(), loss="mse")
    return model


def optimizer_factories():
    """Every optimizer of the Keras under test, with a small learning rate."""
    names = ["SGD", "RMSprop", "Adam", "AdamW", "Adadelta", "Adagrad", "Adamax",
             "Nadam", "Ftrl", "Adafactor", "Lion", "Lamb", "Muon"]
    factories = {}
    for name in names:
        cls = getattr(keras.optimizers, name, None)
        if cls is None:
            continue
        factories[name] = (lambda cls=cls: cls(learning_rate=0.01))
    factories["SGD-momentum"] = lambda: keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True)
    return factories


OPTIMIZER_FACTORIES = optimizer_factories()


@pytest.mark.parametrize("name", sorted(OPTIMIZER_FACTORIES))
def test_every_optimizer_with_sparse_embeddings(name):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 20, size=(64, 6))  # tokens repeat within a batch
    y = rng.normal(size=(64, 1)).astype("float32")
    plain, ours, _ = fit_both(
        lambda: embedding_model(OPTIMIZER_FACTORIES[name]), tokens, y, batch_size=8)
    assert_same(plain, ours)
    assert max_weight_diff(embedding_model(OPTIMIZER_FACTORIES[name]), ours) > 1e-4  # trained
