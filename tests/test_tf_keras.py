"""Keras 2 (`tf_keras`) imported directly next to Keras 3, and multi-worker.

The whole core suite also runs on tf_keras with TF_USE_LEGACY_KERAS=1 (see
the Makefile); these tests cover what that run cannot: a `tf_keras` model in
a process whose `keras` is Keras 3, and MultiWorkerMirroredStrategy across
two worker processes.
"""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from reference import read_run

from tfaccum.dashboard_schema import TAG_PREFIX
from tfaccum import GradientAccumulationCallback

pytestmark = pytest.mark.backend(
    "tensorflow",
    reason="tf_keras")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "multi_worker.py")


def load_example():
    spec = importlib.util.spec_from_file_location("multi_worker", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b, strict=True))


def test_tf_keras_imported_directly_next_to_keras_3():
    import keras

    assert keras.__version__.startswith("3.")
    example = load_example()
    x, y = example.load_data(200)
    reference = example.build_model(tf_keras)
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = example.build_model(tf_keras)
    callback = GradientAccumulationCallback(accumulation_steps=4)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    assert max_diff(reference.get_weights(), model.get_weights()) < 1e-5
    assert max_diff(example.build_model(tf_keras).get_weights(), model.get_weights()) > 1e-2
    # 200 = 6 windows of 32 + a partial one of 8 (one micro-batch), per epoch.
    assert callback.optimizer_steps == 14 == int(model.optimizer.iterations.numpy())
    assert callback.micro_steps == 50 and callback.flushes == 2
    assert "train_step" not in model.__dict__ and isinstance(model, tf_keras.Model)


@pytest.mark.parametrize("keras_version", ["2", "3"])
def test_two_workers_train_like_one_process_at_the_large_batch(keras_version, tmp_path):
    # 300 samples, global micro-batch 16 (8 per worker) x 4 = batch 64: four
    # windows and a partial one of 44 samples (3 micro-batches, the last of
    # 12 split 6/6), per epoch.
    # `verbose` and `log_dir` are given to the chief only.
    log_dir = tmp_path / "logs"
    args = ["--samples", "300", "--micro-batch", "16", "--accumulation-steps", "4",
            "--epochs", "2", "--save", str(tmp_path), "--timeout", "300",
            "--logdir", str(log_dir), "--keras", keras_version]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_USE_LEGACY_KERAS", None)
    result = subprocess.run(
        [sys.executable, EXAMPLE, "--workers", "2", *args],
        capture_output=True, text=True, timeout=420, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "gradients all-reduced 10 times" in result.stdout
    workers = [np.load(tmp_path / f"worker{i}.npz") for i in range(2)]
    weights = [[w[f"arr_{k}"] for k in range(4)] for w in workers]
    assert max_diff(weights[0], weights[1]) == 0  # identical on both workers
    micro_steps, updates, flushes, all_reduces, iterations = workers[0]["counters"]
    assert (micro_steps, updates, flushes) == (38, 10, 2)
    assert all_reduces == updates == iterations  # once per update, not per micro-step
    example = load_example()
    x, y = example.load_data(300)
    keras = tf_keras if keras_version == "2" else importlib.import_module("keras")
    reference = example.build_model(keras)
    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    assert max_diff(reference.get_weights(), weights[0]) < 1e-5
    assert max_diff(example.build_model(keras).get_weights(), weights[0]) > 1e-2
    # The chief printed its epochs and wrote the global windows, once.
    assert result.stdout.count("Epoch 1: 19 micro-steps, 5 optimizer updates") == 1
    series, _ = read_run(str(log_dir))
    assert [float(v) for _, v in series[TAG_PREFIX + "window_samples"]] == [64, 64, 64, 64, 44] * 2
    assert [s for s, _ in series[TAG_PREFIX + "window_samples"]] == list(range(1, 11))
    assert len(os.listdir(log_dir)) == 1  # one event file


@pytest.mark.parametrize("legacy", ["1"])
def test_tf_keras_through_tf_keras_switch(legacy, tmp_path):
    """`tf.keras` is tf_keras under TF_USE_LEGACY_KERAS=1: checked in a fresh process."""
    script = (
        "import tensorflow as tf, numpy as np\n"
        "from tfaccum import GradientAccumulationCallback\n"
        "import tf_keras\n"
        "assert tf.keras.Model is tf_keras.Model\n"
        "m = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])\n"
        "m.compile(optimizer='sgd', loss='mse')\n"
        "cb = GradientAccumulationCallback(accumulation_steps=2)\n"
        "m.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0, callbacks=[cb])\n"
        "print(cb.micro_steps, cb.optimizer_steps)\n"
    )
    env = dict(os.environ, TF_USE_LEGACY_KERAS=legacy, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["4", "2"]


def test_gradients_the_step_aggregated_itself_are_refused():
    class PreAggregated(tf_keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compiled_loss(y, self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(
                zip(grads, self.trainable_variables), skip_gradients_aggregation=True)
            return {}

    model = PreAggregated([tf_keras.Input((3,)), tf_keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    callback = GradientAccumulationCallback(accumulation_steps=2)
    with pytest.raises(ValueError, match=(
            r"cannot take gradients the train step already aggregated. Received: "
            r"optimizer.apply_gradients\(\.\.\., skip_gradients_aggregation=True")):
        model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2, verbose=0,
                  callbacks=[callback])


def test_two_workers_mixed_precision_one_worker_overflows(tmp_path):
    # One worker's share of a micro-batch overflows in float16: that share
    # alone is left out, the loss scale is lowered alike on both workers, and
    # the window equals one process's large batch of the other 56 samples.
    import two_workers_mixed as run

    result = subprocess.run([sys.executable, run.__file__, str(tmp_path)],
                            capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    workers = [np.load(tmp_path / f"worker{i}.npz") for i in range(2)]
    weights = [[w[f"arr_{k}"] for k in range(4)] for w in workers]
    assert max_diff(weights[0], weights[1]) == 0
    for worker in workers:
        assert list(worker["counters"]) == [1, 1, 56, 4]  # skips, updates, samples, micro-steps
        assert list(worker["scale"]) == [2.0**7]
    x, y = run.data()
    share = np.r_[16:24] if run.POISONED < 24 else np.r_[24:32]
    keep = np.setdiff1d(np.arange(64), share)
    reference = run.build_model(tf_keras)
    try:
        reference.fit(x[keep], y[keep], batch_size=56, epochs=1, shuffle=False, verbose=0)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    assert max_diff(reference.get_weights(), weights[0]) < 1e-5


def test_keras3_multi_worker_workaround_is_opt_in_and_guarded(monkeypatch):
    import keras
    from keras.src.backend.tensorflow import trainer

    import tfaccum

    original = trainer.reduce_per_replica
    tfaccum.enable_keras3_multi_worker()
    tfaccum.enable_keras3_multi_worker()  # idempotent
    assert trainer.reduce_per_replica is not original
    tfaccum.disable_keras3_multi_worker()
    assert trainer.reduce_per_replica is original
    # A Keras whose trainer lost what the workaround replaces is refused by
    # name (the version alone decides nothing).
    monkeypatch.setattr(keras, "__version__", "3.99.0")
    monkeypatch.delattr(trainer, "_collective_all_reduce_multi_worker")
    with pytest.raises(RuntimeError, match=(
            r"works around two bugs of Keras 3's TensorFlow trainer .* lacks what it "
            r"replaces: _collective_all_reduce_multi_worker. Received: Keras 3.99.0")):
        tfaccum.enable_keras3_multi_worker()
    assert trainer.reduce_per_replica is original
