"""What each backend's users install: the JAX and PyTorch extras bring no
TensorFlow, and everything those backends serve runs where `import tensorflow`
fails."""

import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirement_name(requirement):
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def brought_by(requirements):
    """Every distribution `requirements` bring, read from the installed packages'
    metadata (markers evaluated for this interpreter, no extras followed)."""
    from packaging.requirements import Requirement

    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = requirement.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(Requirement(r) for r in importlib.metadata.requires(name) or [])
        except importlib.metadata.PackageNotFoundError:
            pass  # not installed here: its own requirements are not known
    return seen


def test_the_jax_extra_brings_no_tensorflow():
    extras = PROJECT["optional-dependencies"]
    jax_users = brought_by(PROJECT["dependencies"] + extras["jax"])
    assert "jax" in jax_users and "keras" in jax_users
    assert not {"tensorflow", "tensorflow-cpu", "tf-keras"} & jax_users, sorted(jax_users)
    # TensorFlow's users name their extra, as Keras' own install asks for a backend.
    assert "tensorflow" in {requirement_name(r) for r in extras["tensorflow"]}
    assert "tensorflow" in {requirement_name(r) for r in extras["tf-keras"]}


def test_the_torch_extra_brings_no_tensorflow():
    torch_users = brought_by(PROJECT["dependencies"] + PROJECT["optional-dependencies"]["torch"])
    assert "torch" in torch_users and "keras" in torch_users
    assert not {"tensorflow", "tensorflow-cpu", "tf-keras", "jax"} & torch_users, sorted(torch_users)


# A child process where TensorFlow cannot be imported, as where it is not installed.
# (None in sys.modules: `import` fails, and `importlib.util.find_spec`, which
# torch asks of packages it may trace, finds nothing.)
WITHOUT_TENSORFLOW = textwrap.dedent("""
    import sys

    sys.modules["tensorflow"] = sys.modules["tf_keras"] = None
""")

EVERYTHING_JAX_SERVES = WITHOUT_TENSORFLOW + textwrap.dedent("""
    import keras
    import numpy as np

    import tfaccum

    keras.utils.set_random_seed(0)
    x = np.random.rand(64, 5).astype("float32")
    y = np.random.rand(64, 1).astype("float32")
    y[17] = np.inf  # a micro-batch left out

    def fit(distribution=None, **options):
        if distribution is not None:
            keras.distribution.set_distribution(distribution)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        callback = tfaccum.GradientAccumulationCallback(accumulation_steps=4, **options)
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[callback])
        keras.distribution.set_distribution(None)
        return callback

    callback = fit(log_dir=sys.argv[1], skip_nonfinite=True, accumulator_dtype="bfloat16",
                   leftover="drop")
    assert callback.nonfinite_skips == 2 and callback.optimizer_steps == 4, callback.counters
    fit(keras.distribution.DataParallel(), reduction="mean", skip_nonfinite=True)
    # A window-wide loss (gradient caching), under DataParallel too.
    for distribution in (None, keras.distribution.DataParallel()):
        if distribution is not None:
            keras.distribution.set_distribution(distribution)
        query, document = keras.Input((5,)), keras.Input((5,))
        towers = [keras.layers.Dense(4)(query), keras.layers.Dense(4)(document)]
        model = keras.Model([query, document], keras.layers.Concatenate()(towers))
        model.compile(optimizer="adam", loss=tfaccum.InBatchSoftmax())
        callback = tfaccum.GradientAccumulationCallback(accumulation_steps=4)
        model.fit([x, x[::-1]], y, batch_size=8, verbose=0, callbacks=[callback])
        keras.distribution.set_distribution(None)
        assert callback.optimizer_steps == 2, callback.counters
    # Accumulation-aware batch normalization: JAX's own layer.
    model = tfaccum.convert_batch_norm(keras.Sequential([
        keras.Input((5,)), keras.layers.BatchNormalization(), keras.layers.Dense(1)]), verbose=0)
    model.compile(optimizer="adam", loss="mse")
    callback = tfaccum.GradientAccumulationCallback(accumulation_steps=4)
    model.fit(x[:32], y[:32], batch_size=8, verbose=0, callbacks=[callback])
    assert callback.optimizer_steps == 1 and np.abs(model.layers[0].moving_mean).max() > 0
    try:
        tfaccum.enable_keras3_multi_worker
    except ImportError as error:
        assert "TensorFlow is not installed" in str(error), error
    else:
        raise AssertionError("enable_keras3_multi_worker without TensorFlow")
    from tb_plugin import plugin  # the dashboard reads the run without TensorFlow
    assert sys.modules["tensorflow"] is None, "tensorflow was imported"
    print("served without TensorFlow")
""")


@pytest.mark.backend("jax", reason="what JAX's users run; the TensorFlow passes import it")
def test_everything_jax_serves_runs_without_tensorflow(tmp_path):
    env = dict(os.environ, KERAS_BACKEND="jax",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, "-c", EVERYTHING_JAX_SERVES, str(tmp_path)],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "served without TensorFlow" in result.stdout
    assert list(tmp_path.rglob("*.tfevents.*"))


EVERYTHING_TORCH_SERVES = WITHOUT_TENSORFLOW + textwrap.dedent("""
    sys.modules["jax"] = None  # nor JAX (Keras imports it where it is installed)

    import keras
    import numpy as np

    import tfaccum

    keras.utils.set_random_seed(0)
    x = np.random.rand(64, 5).astype("float32")
    y = np.random.rand(64, 1).astype("float32")
    y[17] = np.inf  # a micro-batch left out

    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    callback = tfaccum.GradientAccumulationCallback(
        accumulation_steps=4, log_dir=sys.argv[1], skip_nonfinite=True, noise_scale=True,
        leftover="drop")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[callback])
    assert callback.nonfinite_skips == 2 and callback.optimizer_steps == 4, callback.counters
    from tb_plugin import plugin  # the dashboard reads the run without TensorFlow
    assert sys.modules["tensorflow"] is None, "tensorflow was imported"
    print("served without TensorFlow")
""")


@pytest.mark.backend("torch", reason="what PyTorch's users run; the TensorFlow passes import it")
def test_everything_torch_serves_runs_without_tensorflow(tmp_path):
    env = dict(os.environ, KERAS_BACKEND="torch")
    result = subprocess.run([sys.executable, "-c", EVERYTHING_TORCH_SERVES, str(tmp_path)],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "served without TensorFlow" in result.stdout
    assert list(tmp_path.rglob("*.tfevents.*"))


@pytest.mark.backend("tensorflow", reason="the package's files are the same on every backend: "
                     "built and installed once, in the TensorFlow pass")
def test_the_wheel_built_from_the_sdist_installs_and_trains(tmp_path):
    # `python -m build` makes the sdist, then the wheel from it: what is not in
    # the sdist's manifest or the package data is missing from both.
    # From a copy without what installing and building left here (egg-info,
    # build/), which setuptools would take its file list from.
    source, dist, site = tmp_path / "source", tmp_path / "dist", tmp_path / "site"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".*", "*.egg-info", "build", "dist", "site", "__pycache__", "runs", "logs"))
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist),
                            str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    wheel = next(dist.glob("tfaccum-*.whl"))
    assert next(dist.glob("tfaccum-*.tar.gz"))
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                                "--target", str(site), str(wheel)], capture_output=True,
                               text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-2000:]
    smoke = textwrap.dedent("""
        import pathlib, keras, numpy as np, tfaccum, tb_plugin
        assert pathlib.Path(tfaccum.__file__).is_relative_to(pathlib.Path.cwd() / "site")
        assert list(pathlib.Path(tb_plugin.__file__).parent.glob("static/*.js"))
        x, y = np.random.rand(32, 4), np.random.rand(32, 1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        callback = tfaccum.GradientAccumulationCallback(accumulation_steps=4, log_dir="logs")
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[callback])
        assert callback.optimizer_steps == 2, callback.counters
        print("smoke ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(site), TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", smoke], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert "smoke ok" in result.stdout, result.stderr[-3000:]
