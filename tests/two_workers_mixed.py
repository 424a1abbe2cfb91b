"""Two workers training under mixed_float16, one of which overflows (tf_keras).

Run by tests/test_tf_keras.py: `python two_workers_mixed.py OUT` starts the two
workers on 127.0.0.1 and waits; each saves its weights and counters in OUT.
Sample 20 of 64 overflows in float16; it is in the second micro-batch, whose
16 samples the workers share 8 and 8: one worker leaves its share out.
"""

import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import multi_worker  # noqa: E402

POISONED = 20


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    y[POISONED, 0] = 1e5  # its error's gradient times the loss scale > 65504
    return x, y


def build_model(keras):
    """A small regression model under mixed_float16, the same in every process."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, dtype="float32")])
    rng = np.random.default_rng(1)
    model.set_weights([rng.normal(0.0, 0.3, w.shape).astype("float32")
                       for w in model.get_weights()])
    optimizer = keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=2**8)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def train(out):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import tf_keras as keras

    from tfaccum import GradientAccumulationCallback

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    x, y = data()
    with strategy.scope():
        model = build_model(keras)
    callback = GradientAccumulationCallback(accumulation_steps=4)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    scales = strategy.experimental_local_results(model.optimizer._loss_scale.current_loss_scale)
    np.savez(
        os.path.join(out, f"worker{index}.npz"),
        *model.get_weights(),
        counters=np.array([callback.nonfinite_skips, callback.optimizer_steps,
                           callback.samples, callback.micro_steps]),
        scale=np.array([float(s.numpy()) for s in scales]),
    )


def launch(out, workers=2, timeout=300):
    cluster = {"worker": [f"127.0.0.1:{p}" for p in multi_worker.free_ports(workers)]}
    processes = []
    for index in range(workers):
        env = dict(os.environ, TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}))
        env.pop("TF_USE_LEGACY_KERAS", None)
        processes.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", out], env=env))
    try:
        return [p.wait(timeout=timeout) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        train(sys.argv[2])
    else:
        sys.exit(any(launch(sys.argv[1])))
