"""Two JAX processes on 127.0.0.1 training under `keras.distribution.DataParallel`.

Run by tests/test_jax.py: `python two_jax_processes.py OUT CASE` starts the two
processes (one CPU device each, `jax.distributed.initialize`, JAX's CPU
collectives) and waits; each feeds its own shard of the data
(`auto_shard_dataset=False`) and saves its weights and counters in OUT.
CASE is `plain` (Keras alone) or a set of the callback's options by name
(`tfaccum`, `nonfinite`: a sample of the second process's shard is infinite;
`bfloat16`: bfloat16 accumulators; `outputs`: a per-token head and a
per-sequence head on padded sequences, each output's loss over its own count).
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np

SAMPLES, LOCAL_BATCH, STEPS, EPOCHS = 64, 4, 3, 2
POISONED = 32 + 9  # in the second process's shard: its third micro-batch


def data(case):
    rng = np.random.default_rng(0)
    if case == "outputs":  # sequences of 1 to 6 tokens, padded with 0
        x = rng.integers(1, 10, size=(SAMPLES, 6)).astype("int32")
        x[np.arange(6)[None, :] >= rng.integers(1, 7, size=SAMPLES)[:, None]] = 0
        labels = rng.integers(0, 3, size=(SAMPLES, 6)).astype("int32")
        return x, {"per_token": labels,
                   "per_sequence": labels.mean(axis=1, keepdims=True).astype("float32")}
    x = rng.normal(size=(SAMPLES, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    if case == "nonfinite":
        y[POISONED, 0] = np.inf
    return x, y


def shard(array, process):
    if isinstance(array, dict):
        return {name: shard(value, process) for name, value in array.items()}
    half = len(array) // 2
    return array[process * half:(process + 1) * half]


def build_model(keras, case="tfaccum"):
    """The same small model in every process (and in the test's reference)."""
    loss, loss_weights = "mse", None
    if case == "outputs":
        tokens = keras.Input((6,), dtype="int32")
        hidden = keras.layers.Dense(4, activation="tanh")(
            keras.layers.Embedding(10, 4, mask_zero=True)(tokens))
        model = keras.Model(tokens, {
            "per_token": keras.layers.Dense(3, name="per_token")(hidden),
            "per_sequence": keras.layers.Dense(1, name="per_sequence")(
                keras.layers.GlobalAveragePooling1D()(hidden))})
        loss = {"per_token": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                "per_sequence": "mse"}
        loss_weights = {"per_token": 1.0, "per_sequence": 0.5}
    else:
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
    rng = np.random.default_rng(1)
    model.set_weights([rng.normal(0.0, 0.3, w.shape).astype("float32")
                       for w in model.get_weights()])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, loss_weights=loss_weights)
    return model


def train(out, case, process, port):
    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
    import keras

    import tfaccum

    keras.utils.set_random_seed(0)
    distribution = keras.distribution.DataParallel(auto_shard_dataset=False)
    keras.distribution.set_distribution(distribution)
    model = build_model(keras, case)
    x, y = data(case)
    callbacks = []
    if case != "plain":
        callbacks = [tfaccum.GradientAccumulationCallback(
            accumulation_steps=STEPS, log_dir=os.path.join(out, "logs"),
            skip_nonfinite=case == "nonfinite",
            accumulator_dtype="bfloat16" if case == "bfloat16" else "float32")]
    batch = LOCAL_BATCH * (STEPS if case == "plain" else 1)
    model.fit(shard(x, process), shard(y, process), batch_size=batch, epochs=EPOCHS,
              shuffle=False, verbose=0, callbacks=callbacks)
    np.savez(os.path.join(out, f"weights{process}.npz"), *model.get_weights())
    counters = {}
    if callbacks:
        counters = {name: int(value) for name, value in vars(callbacks[0].counters).items()}
    counters["iterations"] = int(np.asarray(model.optimizer.iterations.value))
    with open(os.path.join(out, f"counters{process}.json"), "w") as file:
        json.dump(counters, file)


def main(out, case):
    with socket.socket() as probe:  # a free port for the coordinator
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    children = [subprocess.Popen([sys.executable, __file__, out, case, str(process), str(port)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True) for process in (0, 1)]
    failed = []
    for process, child in enumerate(children):
        output, _ = child.communicate(timeout=300)
        if child.returncode:
            failed.append(f"process {process}:\n{output[-3000:]}")
    if failed:
        sys.exit("\n".join(failed))


if __name__ == "__main__":
    if len(sys.argv) == 5:
        train(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main(sys.argv[1], sys.argv[2])
