"""Gradient accumulation across worker processes (MultiWorkerMirroredStrategy).

Each worker is one process with its own TF_CONFIG; together they train one
model. `fit(batch_size=B)` takes B as the *global* micro-batch: every step,
each of the W workers computes the gradient of its B / W samples, adds it to
its own accumulator, and nothing crosses the network; once per window of N
micro-batches the accumulated gradients are all-reduced and applied. The
model trains exactly as one process would at batch N * B, with N times
fewer all-reduces than plain training.

Runs on Keras 2 (`tf_keras`) by default; `--keras 3` runs Keras 3, whose
`fit` fails under this strategy upstream (keras-team/keras#20585) unless
`tfaccum.enable_keras3_multi_worker()` works around it. Data:
scikit-learn's bundled digits.

Two workers on this machine (this script starts them):

    python examples/multi_worker.py --workers 2 [--keras 3]

One worker per machine (run on each, with that machine's index):

    TF_CONFIG='{"cluster": {"worker": ["host0:12345", "host1:12345"]},
                "task": {"type": "worker", "index": 0}}' \\
        python examples/multi_worker.py
"""

import argparse
import json
import os
import socket
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def load_data(samples=None):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    return x[:samples], y[:samples]


def build_model(keras, seed=0):
    """A small classifier with initial weights drawn by NumPy from `seed`.

    Identical in every process (and in a single-process reference), whatever
    strategy it is built under.
    """
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    rng = np.random.default_rng(seed)
    model.set_weights(
        [rng.normal(0.0, 0.2, w.shape).astype("float32") for w in model.get_weights()]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def count_all_reduces(counter):
    """Counts, at run time, the all-reduces made from a replica's step.

    The accumulator all-reduces a window's gradients that way, once per update.
    """
    import tensorflow as tf

    all_reduce = tf.distribute.ReplicaContext.all_reduce

    def counting(context, reduce_op, value, options=None):
        reduced = all_reduce(context, reduce_op, value, options)
        with tf.control_dependencies(tf.nest.flatten(reduced)):
            counter.assign_add(1)
        return reduced

    tf.distribute.ReplicaContext.all_reduce = counting


def train(args):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
    import tfaccum
    from tfaccum import GradientAccumulationCallback

    if args.keras == "3":
        import keras

        tfaccum.enable_keras3_multi_worker()  # Keras 3's fit needs it across workers
    else:
        import tf_keras as keras

    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    index = task.get("index", 0)
    x, y = load_data(args.samples)
    with strategy.scope():
        model = build_model(keras)
    all_reduces = tf.Variable(0, dtype=tf.int64, trainable=False)
    count_all_reduces(all_reduces)
    # Every worker needs the callback: it is what accumulates. What only
    # shows (`verbose`, `log_dir`) can be the chief's alone: counters are
    # read locally and the summaries start no collective.
    chief = index == 0
    callback = GradientAccumulationCallback(
        accumulation_steps=args.accumulation_steps,
        verbose=1 if chief else 0,
        log_dir=args.logdir if chief else None,
    )
    model.fit(
        x,
        y,
        batch_size=args.micro_batch,  # global: split between the workers
        epochs=args.epochs,
        shuffle=False,
        callbacks=[callback],
        verbose=2 if index == 0 else 0,
    )
    counters = [
        callback.micro_steps,
        callback.optimizer_steps,
        callback.flushes,
        int(all_reduces.numpy()),
        int(model.optimizer.iterations.numpy()),
    ]
    if index == 0:
        print(
            f"{strategy.num_replicas_in_sync} workers, global micro-batch "
            f"{args.micro_batch} x {args.accumulation_steps} accumulated = batch "
            f"{args.micro_batch * args.accumulation_steps}: {counters[0]} "
            f"micro-steps, {counters[1]} updates, gradients all-reduced "
            f"{counters[3]} times."
        )
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        np.savez(
            os.path.join(args.save, f"worker{index}.npz"),
            *model.get_weights(),
            counters=np.array(counters),
        )


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launch(args, argv):
    """Starts `args.workers` workers of this script on 127.0.0.1 and waits."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(args.workers)]}
    argv = [a for a in argv if not a.startswith("--workers=")]
    if "--workers" in argv:  # the workers get every option but this one
        at = argv.index("--workers")
        argv = argv[:at] + argv[at + 2 :]
    workers = []
    for index in range(args.workers):
        env = dict(
            os.environ,
            TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}
            ),
        )
        workers.append(
            subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env)
        )
    try:
        codes = [worker.wait(timeout=args.timeout) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    if any(codes):
        sys.exit(f"worker exit codes: {codes}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=0,
                        help="start this many local workers (default: be one, per TF_CONFIG)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=32, help="global micro-batch")
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=None, help="use the first N samples")
    parser.add_argument("--save", default=None, help="directory for each worker's weights")
    parser.add_argument("--keras", choices=["2", "3"], default="2",
                        help="tf_keras (default), or Keras 3 with tfaccum.enable_keras3_multi_worker()")
    parser.add_argument("--logdir", default=None,
                        help="the chief's TensorBoard log directory (Accumulation tab)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds (launcher)")
    args = parser.parse_args(argv)
    if args.workers:
        launch(args, argv)
    else:
        train(args)


if __name__ == "__main__":
    main()
