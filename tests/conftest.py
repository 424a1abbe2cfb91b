import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

# The suite runs on Keras 3, and again on Keras 2 (`tf_keras`) with
# TF_USE_LEGACY_KERAS=1 (`make test` does both). Tests take `keras` from here.
if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
    keras = tf.keras  # tf_keras, as its users get it
    KERAS = "tf_keras"
else:
    import keras  # noqa: E402

    KERAS = "keras3"

# Two logical CPUs, for tests with a two-replica MirroredStrategy. Must happen
# before TensorFlow initialises its devices.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)


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


def make_model(kind="sequential", optimizer="sgd", seed=1, features=5, **compile_kwargs):
    """A small MLP with deterministic weights; `optimizer` is a name or a factory."""
    keras.utils.set_random_seed(seed)
    if kind == "sequential":
        model = keras.Sequential(
            [
                keras.Input((features,)),
                keras.layers.Dense(7, activation="tanh"),
                keras.layers.Dense(1),
            ]
        )
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


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw_clipnorm": lambda: keras.optimizers.AdamW(
        0.01, weight_decay=0.05, clipnorm=0.1
    ),
    "adam_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9),
}


def iterations(model):
    """`model.optimizer.iterations` as an int, as its schedules see it.

    (Keras 3 before 3.9 leaves a LossScaleOptimizer's own counter at 0 and
    counts in its inner optimizer.)
    """
    optimizer = model.optimizer
    optimizer = getattr(optimizer, "inner_optimizer", None) or optimizer
    return int(optimizer.iterations.numpy())


def max_weight_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
        for u, v in zip(a.get_weights(), b.get_weights(), strict=True)
    )


@pytest.fixture
def mixed_precision():
    """The mixed_float16 policy for one test."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def data():
    return make_data()


def pytest_report_header(config):
    return f"Keras under test: {KERAS} {getattr(keras, '__version__', '')}"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "keras3: exercises what only Keras 3 has (deselected in the tf_keras run)",
    )
