"""Session set-up and fixtures; what tests share to import is in reference.py."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402

if os.environ.get("KERAS_BACKEND") == "jax":
    # Two CPU devices, for keras.distribution's data parallelism. Must be
    # set before JAX initialises its backend. TensorFlow is not imported.
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
elif os.environ.get("KERAS_BACKEND") == "torch":
    pass  # one CPU device; TensorFlow is not imported
else:
    import tensorflow as tf

    # Two logical CPUs, for tests with a two-replica MirroredStrategy. Must
    # happen before TensorFlow initialises its devices.
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * 2,
    )

# Each pass runs the files written for every backend, and its own backend's
# file (test_jax.py, test_torch.py) only there.
collect_ignore = [f"test_{name}.py" for name in ("jax", "torch")
                  if os.environ.get("KERAS_BACKEND") != name]

from reference import KERAS  # noqa: E402
from reference import keras  # noqa: E402
from reference import make_data  # noqa: E402


@pytest.fixture
def mixed_precision():
    """The mixed_float16 policy for one test."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def data():
    return make_data()


# Longest first: the files that run whole scripts in fresh processes (and the
# keras_hub tasks) start while the many short tests wait, so that the two
# workers finish together rather than one waiting on the other's last script.
SLOW_FIRST = ("test_examples_models.py", "test_tf_keras.py", "test_examples.py",
              "test_keras_hub.py", "test_fuzz.py")


BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable
    for item in items:
        marker = item.get_closest_marker("backend")
        if marker is not None and BACKEND not in marker.args:
            item.add_marker(pytest.mark.skip(
                reason=f"Keras on {' or '.join(marker.args)} only: {marker.kwargs['reason']}"))


def pytest_report_header(config):
    return f"Keras under test: {KERAS} {getattr(keras, '__version__', '')}"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "backend(*names, reason): what only these Keras backends have; skipped on the "
        "others with the reason (where another backend refuses it, the refusal's test is named)",
    )
    config.addinivalue_line(
        "markers",
        "keras3: exercises what only Keras 3 has (deselected in the tf_keras run)",
    )
    config.addinivalue_line(
        "markers",
        "once: version-independent, run on Keras 3 only; the tf_keras run re-checks "
        "the core cases beside it (deselected there to keep the suite's time)",
    )
