"""AccumBatchNormalization and convert_batch_norm."""

import contextlib
import inspect
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from reference import BACKEND
from reference import iterations
from reference import make_data
from reference import max_weight_diff

from reference import NOT_ON_TORCH

if BACKEND == "torch":
    pytest.skip(NOT_ON_TORCH["batch_norm"], allow_module_level=True)

import tfaccum
from tfaccum import AccumBatchNormalization
from tfaccum import GradientAccumulationCallback

# What only TensorFlow has here: tf.distribute's replicas.
CONVERT = pytest.mark.keras3  # (tf_keras' twin: test_keras2_layers.py)
REPLICAS = pytest.mark.backend(
    "tensorflow", reason="MirroredStrategy replicas (BatchNormalization under JAX's "
    "DataParallel is refused by name: test_jax.py)")

TOL = 1e-5


def bn_model(layer_class, input_shape=(5,), seed=1, optimizer=None, **bn_kwargs):
    """The BN layer sees the data itself, so its statistics do not depend on
    how the other weights trained: they must match the large batch exactly."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input(input_shape),
        layer_class(momentum=0.8, **bn_kwargs),
        keras.layers.Flatten(),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01), loss="mse")
    return model


def moving_statistics(model):
    layer = model.layers[0]
    return np.array(layer.moving_mean), np.array(layer.moving_variance)


def assert_statistics_equal(a, b):
    for u, v in zip(moving_statistics(a), moving_statistics(b)):
        np.testing.assert_allclose(u, v, atol=TOL, rtol=TOL)


def shifted_data(n=100, seed=0):
    """Features whose scale and offset differ: micro-batch means vary."""
    x, y = make_data(n=n, seed=seed)
    return x * np.arange(1, 6, dtype="float32") + np.arange(5, dtype="float32"), y


@pytest.mark.parametrize("leftover", ["flush", "drop"])
def test_moving_statistics_equal_the_large_batch(leftover):
    x, y = shifted_data()  # 100 samples: a short last micro-batch, a partial window
    reference = bn_model(keras.layers.BatchNormalization)
    xs, ys = (x[:96], y[:96]) if leftover == "drop" else (x, y)
    reference.fit(xs, ys, batch_size=32, epochs=3, shuffle=False, verbose=0)
    model = bn_model(AccumBatchNormalization)
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4, leftover=leftover)])
    assert_statistics_equal(reference, model)
    # Plain BatchNormalization at micro-batches ends elsewhere.
    plain = bn_model(keras.layers.BatchNormalization)
    plain.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    assert np.abs(moving_statistics(plain)[1] - moving_statistics(reference)[1]).max() > 1e-2


@pytest.mark.backend("tensorflow", reason="TensorFlow's pooled window read directly; on JAX the "
                     "same pooling through fit: test_moving_statistics_equal_the_large_batch")
def test_pooled_variance_includes_the_variance_between_micro_batches():
    import tensorflow as tf

    """Two micro-batches with different means: their average variance is not it."""
    layer = AccumBatchNormalization(momentum=0.0)
    layer.build((None, 1))
    window = layer._new_pooled(tf.distribute.get_strategy())
    layer._set_pooled(window)
    layer(np.array([[0.0], [2.0]], "float32"), training=True)  # mean 1, variance 1
    window.commit()  # the hook commits a micro-batch when its gradient joins
    layer(np.array([[10.0], [12.0], [14.0]], "float32"), training=True)  # mean 12, var 8/3
    window.commit()
    layer(np.array([[1e6], [np.nan]], "float32"), training=True)  # left out:
    window.discard()  # its gradient was not finite
    layer._apply_window_moments()
    everything = np.array([0, 2, 10, 12, 14], "float32")
    np.testing.assert_allclose(np.array(layer.moving_mean), [everything.mean()], rtol=1e-6)
    np.testing.assert_allclose(np.array(layer.moving_variance), [everything.var()], rtol=1e-6)
    assert everything.var() > (1 + 8 / 3) / 2 * 5  # far above the mean of the variances


def test_without_the_callback_it_is_batch_normalization():
    x, y = shifted_data()
    reference = bn_model(keras.layers.BatchNormalization)
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = bn_model(AccumBatchNormalization)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(reference, model) == 0
    np.testing.assert_array_equal(model.predict(x, verbose=0), reference.predict(x, verbose=0))


def test_same_arguments_defaults_and_config():
    plain = keras.layers.BatchNormalization(axis=1, momentum=0.9, epsilon=1e-4, center=False)
    ours = AccumBatchNormalization(axis=1, momentum=0.9, epsilon=1e-4, center=False)
    assert ours.get_config() | {"name": None} == plain.get_config() | {"name": None}
    defaults = AccumBatchNormalization().get_config()
    assert {k: v for k, v in defaults.items() if k != "name"} == {
        k: v for k, v in keras.layers.BatchNormalization().get_config().items() if k != "name"}


def test_any_axis():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(100, 3, 4)) * [[1], [5], [10]]).astype("float32")
    y = rng.normal(size=(100, 1)).astype("float32")
    reference = bn_model(keras.layers.BatchNormalization, input_shape=(3, 4), axis=1)
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = bn_model(AccumBatchNormalization, input_shape=(3, 4), axis=1)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    assert moving_statistics(model)[0].shape == (3,)
    assert_statistics_equal(reference, model)


def test_masks():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 6, 2)).astype("float32") + 3.0
    lengths = rng.integers(1, 7, size=100)
    x[np.arange(6)[None, :] >= lengths[:, None]] = 0.0  # padding, masked out
    y = rng.normal(size=(100, 1)).astype("float32")

    def masked_model(layer_class):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([
            keras.Input((6, 2)),
            keras.layers.Masking(0.0),
            layer_class(momentum=0.8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer="adam", loss="mse")
        return model

    reference = masked_model(keras.layers.BatchNormalization)
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = masked_model(AccumBatchNormalization)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    for a, b in ((reference.layers[1], model.layers[1]),):
        np.testing.assert_allclose(np.array(a.moving_mean), np.array(b.moving_mean), atol=1e-4)
        np.testing.assert_allclose(np.array(a.moving_variance), np.array(b.moving_variance), atol=1e-4)


def test_mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = shifted_data()

        def scaled_adam():  # a loss scale these models never overflow at
            return keras.optimizers.LossScaleOptimizer(
                keras.optimizers.Adam(0.01), initial_scale=2**8)

        reference = bn_model(keras.layers.BatchNormalization, optimizer=scaled_adam())
        reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        assert iterations(reference) == 8  # no step overflowed
        model = bn_model(AccumBatchNormalization, optimizer=scaled_adam())
        callback = GradientAccumulationCallback(accumulation_steps=4)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[callback])
        assert callback.nonfinite_skips == 0
        # Statistics are computed in float32 from the same float16 inputs.
        assert model.layers[0].compute_dtype == "float16"
        assert_statistics_equal(reference, model)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_save_and_load(tmp_path):
    x, y = shifted_data()
    model = bn_model(AccumBatchNormalization)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)  # registered: no custom_objects
    assert isinstance(loaded.layers[0], AccumBatchNormalization)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert len(loaded.layers[0].weights) == 4  # gamma, beta, moving mean and variance


@CONVERT
def test_convert_batch_norm():
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3)(inputs)
    h = keras.layers.BatchNormalization(momentum=0.7)(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Conv2D(4, 3)(h)
    h = keras.layers.BatchNormalization(epsilon=1e-2)(h)
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs)
    x = np.random.default_rng(0).normal(size=(16, 8, 8, 3)).astype("float32")
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, np.zeros((16, 2)), epochs=1, verbose=0)  # non-trivial moving statistics
    converted = tfaccum.convert_batch_norm(model)
    norms = [layer for layer in converted.layers
             if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) == 2 and all(isinstance(n, AccumBatchNormalization) for n in norms)
    for old, new in zip(model.layers, converted.layers):
        if isinstance(old, keras.layers.BatchNormalization):
            assert new.get_config() | {"name": None} == old.get_config() | {"name": None}
    np.testing.assert_allclose(converted.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    assert converted is not model and isinstance(model.layers[2], keras.layers.BatchNormalization)


def nested_bn_model(layer_class=keras.layers.BatchNormalization, seed=1):
    """A functional and a Sequential model nested in a functional one.

    Each normalisation sees the data itself, so its statistics do not depend
    on how the other weights trained (nor on another layer's micro-batch
    normalisation): they must match the large batch exactly.
    """
    keras.utils.set_random_seed(seed)
    inner_in = keras.Input((5,))
    inner = keras.Model(inner_in, keras.layers.Dense(1)(layer_class(momentum=0.8)(inner_in)),
                        name="backbone")
    head = keras.Sequential([keras.Input((5,)), layer_class(momentum=0.5), keras.layers.Dense(1)],
                            name="head")
    inputs = keras.Input((5,))
    model = keras.Model(inputs, keras.layers.Add()([inner(inputs), head(inputs)]))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def all_statistics(model):
    return [np.array(w) for layer in model._flatten_layers(recursive=True)
            if isinstance(layer, keras.layers.BatchNormalization)
            for w in (layer.moving_mean, layer.moving_variance)]


@CONVERT
def test_convert_batch_norm_walks_nested_models(capsys):
    x, y = shifted_data()
    model = nested_bn_model()
    converted = tfaccum.convert_batch_norm(model)
    assert "Converted 2 BatchNormalization layers to AccumBatchNormalization." in capsys.readouterr().out
    norms = [layer for layer in converted._flatten_layers(recursive=True)
             if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) == 2 and all(isinstance(n, AccumBatchNormalization) for n in norms)
    assert type(converted) is type(model)
    assert [m.name for m in converted.layers if isinstance(m, keras.Model)] == ["backbone", "head"]
    np.testing.assert_array_equal(converted.predict(x, verbose=0), model.predict(x, verbose=0))
    assert all(type(layer) is keras.layers.BatchNormalization  # the original is left alone
               for layer in model._flatten_layers(recursive=True) if "batch_norm" in layer.name)
    # Accumulated, the nested layers' moving statistics are the large batch's.
    reference = nested_bn_model()
    reference.fit(x[:96], y[:96], batch_size=32, epochs=2, shuffle=False, verbose=0)
    converted.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    converted.fit(x[:96], y[:96], batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    for got, want in zip(all_statistics(converted), all_statistics(reference)):
        np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
    # Without the conversion the nested layers update per micro-batch.
    plain = nested_bn_model()
    plain.fit(x[:96], y[:96], batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    assert max(np.abs(a - b).max() for a, b in zip(all_statistics(plain),
                                                   all_statistics(reference))) > 1e-2


@CONVERT
def test_convert_batch_norm_in_place_works_for_subclassed_models(capsys):
    class Net(keras.Model):  # not serializable (a function argument): no copy can be made
        def __init__(self, activation=lambda t: t):
            super().__init__()
            self.activation = activation
            self.norm = keras.layers.BatchNormalization(momentum=0.8)
            self.dense = keras.layers.Dense(1)

        def call(self, x, training=False):
            return self.activation(self.dense(self.norm(x, training=training)))

    x, y = shifted_data()
    net = Net()
    net.compile(optimizer="sgd", loss="mse")
    net.fit(x, y, batch_size=32, epochs=1, verbose=0)  # traced with the plain layer
    with pytest.raises(ValueError, match="(?s)could not copy model .* Pass `in_place=True`"):
        tfaccum.convert_batch_norm(net)
    assert tfaccum.convert_batch_norm(net, in_place=True, verbose=0) is net
    assert isinstance(net.norm, AccumBatchNormalization) and capsys.readouterr().out == ""
    before = all_statistics(net)
    callback = GradientAccumulationCallback(accumulation_steps=4)
    net.fit(x[:32], y[:32], batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    after = all_statistics(net)
    # One window: the moving mean moved once, by (1 - momentum) towards the batch mean.
    expected = 0.8 * before[0] + 0.2 * x[:32].mean(axis=0)
    np.testing.assert_allclose(after[0], expected, rtol=1e-5, atol=1e-6)


@CONVERT
def test_a_converted_model_saves_as_plain_batch_normalization(tmp_path):
    """Loadable anywhere, tfaccum or not; convert again to keep accumulating."""
    x, y = shifted_data()
    converted = tfaccum.convert_batch_norm(nested_bn_model(), verbose=0)
    converted.compile(optimizer="sgd", loss="mse")
    converted.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    converted.save(tmp_path / "model.keras")
    script = (
        "import sys, keras, numpy as np\n"
        f"model = keras.models.load_model({str(tmp_path / 'model.keras')!r})\n"
        "assert 'tfaccum' not in sys.modules\n"
        "norms = [l for l in model._flatten_layers(recursive=True)"
        " if isinstance(l, keras.layers.BatchNormalization)]\n"
        "assert [type(n) for n in norms] == [keras.layers.BatchNormalization] * 2, norms\n"
        f"np.save({str(tmp_path / 'out.npy')!r}, model.predict(np.load({str(tmp_path / 'x.npy')!r}),"
        " verbose=0))\n")
    np.save(tmp_path / "x.npy", x)
    subprocess.run([sys.executable, "-c", script], check=True, env=dict(
        os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), converted.predict(x, verbose=0),
                               rtol=1e-6)
    again = tfaccum.convert_batch_norm(keras.models.load_model(tmp_path / "model.keras"),
                                       verbose=0)
    assert max_weight_diff(again, converted) == 0


@CONVERT
def test_convert_batch_norm_refusals():
    class OwnNorm(keras.layers.BatchNormalization):
        pass

    model = keras.Sequential([keras.Input((3,)), OwnNorm(name="own")])
    with pytest.raises(ValueError, match="'own' \\(OwnNorm\\).*subclass `tfaccum.AccumBatchNormalization`"):
        tfaccum.convert_batch_norm(model)
    with pytest.raises(ValueError, match="Keras model. Received: model=3"):
        tfaccum.convert_batch_norm(3)
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="`in_place` must be True or False. Received: in_place=1"):
        tfaccum.convert_batch_norm(plain, in_place=1)
    with pytest.raises(ValueError, match="`verbose` must be 0 or 1. Received: verbose=2"):
        tfaccum.convert_batch_norm(plain, verbose=2)
    with pytest.warns(UserWarning, match="found no BatchNormalization layer"):
        tfaccum.convert_batch_norm(plain, verbose=0)


def test_renorm_is_refused_under_accumulation():
    x, y = shifted_data(n=16)
    if "renorm" not in inspect.signature(keras.layers.BatchNormalization).parameters:
        # Keras before 3.14 has no renormalization (and no `renorm`
        # attribute): nothing to refuse, and the layer accumulates.
        model = bn_model(AccumBatchNormalization)
        assert not hasattr(model.layers[0], "renorm")
        model.fit(x, y, batch_size=8, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=2)])
        return
    model = bn_model(AccumBatchNormalization, renorm=True)
    with pytest.raises(ValueError, match=r"`renorm=True` is not supported under gradient accumulation"):
        model.fit(x, y, batch_size=8, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=2)])


@REPLICAS
def test_under_mirrored_strategy_each_replica_pools_its_own_window():
    """Runs and stays finite; the statistics follow Keras' own layer there,
    which keeps each replica's share (not the single-device statistics)."""
    import tensorflow as tf

    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    x, y = shifted_data()
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice())  # see test_distribution
    with strategy.scope():
        model = bn_model(AccumBatchNormalization)
    callback = GradientAccumulationCallback(accumulation_steps=4)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    mean, variance = moving_statistics(model)
    assert callback.optimizer_steps == 8
    assert np.all(np.isfinite(mean)) and np.all(variance > 0)
    assert np.abs(mean).max() > 0.1  # it moved from its initial zeros


@REPLICAS
@pytest.mark.parametrize("leftover", ["flush", "drop"])
def test_synchronized_pools_the_window_across_replicas(leftover):
    import tensorflow as tf

    # Two replicas, 4 samples each per micro-batch of 8, 4 per window: the
    # moving statistics are single-device BatchNormalization's at batch 32.
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    # 83 samples: a partial window of 8, 8 and 3 (split 2 and 1) samples per
    # micro-batch, weighed by the counts over every replica.
    x, y = shifted_data(n=83)
    reference = bn_model(keras.layers.BatchNormalization)
    xs, ys = (x[:64], y[:64]) if leftover == "drop" else (x, y)
    reference.fit(xs, ys, batch_size=32, epochs=3, shuffle=False, verbose=0)
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice())  # see test_distribution
    with strategy.scope():
        model = bn_model(AccumBatchNormalization, synchronized=True)
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4, leftover=leftover)])
    assert_statistics_equal(reference, model)
    layer = model.layers[0]
    for variable in (layer.moving_mean, layer.moving_variance):  # alike on each replica
        value = getattr(variable, "value", variable)
        local = strategy.experimental_local_results(value)
        np.testing.assert_array_equal(np.asarray(local[0]), np.asarray(local[-1]))

@CONVERT
@pytest.mark.parametrize("sharing", ["layer", "sub-model"])
def test_a_shared_layer_is_refused_by_name(sharing):
    # BatchNormalization moves a shared layer's statistics once per call;
    # a window pools once per layer: neither would be the large batch's.
    keras.utils.set_random_seed(1)
    first, second = keras.Input((5,)), keras.Input((5,))
    bn = keras.layers.BatchNormalization(momentum=0.5, name="shared_bn")
    if sharing == "sub-model":
        bn = keras.Sequential([keras.Input((5,)), bn], name="tower")
    joined = keras.layers.Concatenate()([bn(first), bn(second)])
    model = tfaccum.convert_batch_norm(keras.Model([first, second], keras.layers.Dense(1)(joined)),
                                       verbose=0)
    model.compile(optimizer="sgd", loss="mse")
    x, y = shifted_data(n=32)
    with pytest.raises(ValueError, match=r"AccumBatchNormalization layer 'shared_bn' is called 2 "
                       r"times in one train step .*Give each call a layer of its own"):
        model.fit([x, x + 1.0], y, batch_size=4, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    assert iterations(model) == 0
    # On TensorFlow the next `fit` removes the hook the failed one left; JAX's
    # hook removed itself as its first step failed.
    removed = (pytest.warns(UserWarning, match="did not finish") if BACKEND == "tensorflow"
               else contextlib.nullcontext())
    with removed:
        model.fit([x, x + 1.0], y, batch_size=4, verbose=0)  # the model trains plainly
    assert iterations(model) == 8


def test_a_layer_called_once_per_step_is_not_shared():
    """Traced again (a new graph), or stepped eagerly: one call per step each time."""
    x, y = shifted_data(n=32)
    for run_eagerly in (False, True):
        model = bn_model(AccumBatchNormalization)
        model.compile(optimizer="sgd", loss="mse", run_eagerly=run_eagerly)
        for _ in range(2):
            model.fit(x, y, batch_size=4, verbose=0,
                      callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
        assert iterations(model) == 4
