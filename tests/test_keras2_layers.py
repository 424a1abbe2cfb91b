"""tf_keras' `AccumBatchNormalization` (`tfaccum.backend.tensorflow.batch_norm.keras2`) and
`convert_batch_norm` on tf_keras models.

tf_keras models imported directly, in whichever Keras process runs the suite,
against tf_keras' own `BatchNormalization` at the large batch: fused (4D
inputs, tf_keras' default) and not.
"""

import numpy as np
import pytest

import tfaccum
from tfaccum import GradientAccumulationCallback

tf_keras = pytest.importorskip("tf_keras")  # part of the test extra
from tfaccum.backend.tensorflow.batch_norm.keras2 import AccumBatchNormalization  # noqa: E402

pytestmark = pytest.mark.backend(
    "tensorflow",
    reason="tf_keras' layers")

TOL = 1e-5


def images(n=100, seed=0):
    """Channels with different scales and offsets: micro-batch moments vary."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4, 4, 3)) * [1.0, 3.0, 0.5] + [0.0, 2.0, -1.0]
    return x.astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def model_with(layer, input_shape=(4, 4, 3), seed=1):
    """The normalisation sees the data itself: its statistics must be the large batch's."""
    tf_keras.utils.set_random_seed(seed)
    model = tf_keras.Sequential([
        tf_keras.Input(input_shape), layer, tf_keras.layers.Flatten(), tf_keras.layers.Dense(1)])
    model.compile(optimizer=tf_keras.optimizers.Adam(0.01), loss="mse")
    return model


def statistics(model):
    layer = model.layers[0]
    return np.array(layer.moving_mean), np.array(layer.moving_variance)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "not-fused"])
@pytest.mark.parametrize("leftover", ["flush", "drop"])
def test_moving_statistics_equal_the_large_batch(fused, leftover):
    x, y = images()  # 100: a short last micro-batch, a partial window
    xs, ys = (x[:96], y[:96]) if leftover == "drop" else (x, y)
    reference = model_with(tf_keras.layers.BatchNormalization(momentum=0.8, fused=fused))
    reference.fit(xs, ys, batch_size=32, epochs=3, shuffle=False, verbose=0)
    model = model_with(AccumBatchNormalization(momentum=0.8, fused=fused))
    assert model.layers[0].fused is fused
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4, leftover=leftover)])
    for got, want in zip(statistics(model), statistics(reference)):
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    plain = model_with(tf_keras.layers.BatchNormalization(momentum=0.8, fused=fused))
    plain.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    assert np.abs(statistics(plain)[1] - statistics(reference)[1]).max() > 1e-2


def test_without_the_callback_it_is_batch_normalization():
    x, y = images()
    reference = model_with(tf_keras.layers.BatchNormalization())
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model = model_with(AccumBatchNormalization())
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_array_equal(model.predict(x, verbose=0), reference.predict(x, verbose=0))
    config = AccumBatchNormalization(momentum=0.7).get_config()
    assert config | {"name": None} == (
        tf_keras.layers.BatchNormalization(momentum=0.7).get_config() | {"name": None})


def test_unsupported_options_are_refused_by_name():
    x, y = images()
    model = model_with(AccumBatchNormalization(virtual_batch_size=4))
    with pytest.raises(ValueError, match="`virtual_batch_size` is not supported .* "
                                         "Received: virtual_batch_size=4"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=4)])


def nested(seed=1):
    tf_keras.utils.set_random_seed(seed)
    inner_in = tf_keras.Input((4, 4, 3))
    inner = tf_keras.Model(
        inner_in, tf_keras.layers.BatchNormalization(momentum=0.8)(inner_in), name="backbone")
    inputs = tf_keras.Input((4, 4, 3))
    outputs = tf_keras.layers.Dense(1)(tf_keras.layers.Flatten()(inner(inputs)))
    model = tf_keras.Model(inputs, outputs)
    model.compile(optimizer=tf_keras.optimizers.Adam(0.01), loss="mse")
    return model


def test_convert_batch_norm_on_a_nested_tf_keras_model(tmp_path, capsys):
    x, y = images()
    model = nested()
    converted = tfaccum.convert_batch_norm(model)
    assert "Converted 1 BatchNormalization layer to" in capsys.readouterr().out
    layer = converted.get_layer("backbone").layers[1]
    assert isinstance(layer, AccumBatchNormalization) and type(converted) is type(model)
    assert type(model.get_layer("backbone").layers[1]) is tf_keras.layers.BatchNormalization
    reference = nested()
    reference.fit(x[:96], y[:96], batch_size=32, epochs=2, shuffle=False, verbose=0)
    converted.compile(optimizer=tf_keras.optimizers.Adam(0.01), loss="mse")
    converted.fit(x[:96], y[:96], batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    want = reference.get_layer("backbone").layers[1]
    for got, expected in ((layer.moving_mean, want.moving_mean),
                          (layer.moving_variance, want.moving_variance)):
        np.testing.assert_allclose(np.array(got), np.array(expected), rtol=TOL, atol=TOL)
    # Saved as plain BatchNormalization: loads without tfaccum's classes.
    converted.save(tmp_path / "model.keras")
    loaded = tf_keras.models.load_model(tmp_path / "model.keras")
    assert type(loaded.get_layer("backbone").layers[1]) is tf_keras.layers.BatchNormalization
    np.testing.assert_allclose(loaded.predict(x, verbose=0), converted.predict(x, verbose=0),
                               rtol=1e-6)


def test_synchronized_pools_the_window_across_replicas():
    # As the Keras 3 layer (test_layers): 83 samples end in a partial window
    # of micro-batches of 8, 8 and 3 (split 2 and 1 between the replicas).
    import tensorflow as tf

    x, y = images(n=83)
    reference = model_with(tf_keras.layers.BatchNormalization(momentum=0.8, fused=False))
    reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice())  # see test_distribution
    with strategy.scope():
        model = model_with(AccumBatchNormalization(momentum=0.8, synchronized=True))
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    for got, want in zip(statistics(model), statistics(reference)):
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
