"""One training run for tests/test_backup.py, in a process of its own.

`python tests/backup_script.py CONFIG.json`: trains the issue's MLP with
`tfaccum.BackupAndRestore` beside the accumulation callback, killing itself
(SIGKILL) where `kill` says, and writes the finished run's weights, counters
and `optimizer.iterations` to `CONFIG["out"]`. Run again after a kill, the
same command resumes from the backup.
"""

import json
import os
import random
import signal
import sys

import numpy as np

config = json.loads(open(sys.argv[1]).read())
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import tfaccum  # noqa: E402
from tfaccum import _keras  # noqa: E402
from tfaccum import backup_files  # noqa: E402

if config.get("devices"):  # two devices: DataParallel on JAX, MirroredStrategy on TensorFlow
    if keras.backend.backend() == "jax":
        keras.distribution.set_distribution(keras.distribution.DataParallel())
    else:
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        scope = strategy.scope()  # held: the model and its optimizer are made in it
        scope.__enter__()
# keras.utils.set_random_seed, without importing the frameworks this run does not use.
random.seed(7)
np.random.seed(7)
if keras.backend.backend() == "tensorflow":
    keras.utils.set_random_seed(7)
elif keras.backend.backend() == "torch":
    import torch

    torch.manual_seed(7)
rng = np.random.default_rng(0)
x = rng.normal(size=(config.get("samples", 40), 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
batch_size = config.get("batch_size", 4)
data = {"x": x, "y": y, "batch_size": batch_size}
if config.get("source") == "pydataset":
    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return -(-len(x) // batch_size)

        def __getitem__(self, index):
            part = slice(index * batch_size, (index + 1) * batch_size)
            return x[part], y[part]

    data = {"x": Batches()}
elif config.get("source") == "tf.data":
    import tensorflow as tf

    data = {"x": tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a * 2, b)).batch(
        batch_size)}
layers = [keras.Input((8,)), keras.layers.Dense(16, activation="relu")]
if config.get("batch_norm"):  # moving statistics: non-trainable variables in the backup
    layers.append(keras.layers.BatchNormalization())
model = keras.Sequential(layers + [keras.layers.Dropout(config.get("dropout", 0.25)),
                                   keras.layers.Dense(1)])
schedule = keras.optimizers.schedules.CosineDecay(0.01, decay_steps=40)
# EMA: the optimizer's averages, updated once per window, in the backup too.
optimizer = keras.optimizers.Adam(schedule, use_ema=bool(config.get("ema")))
model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
accumulation = tfaccum.GradientAccumulationCallback(
    accumulation_steps=config.get("steps", 3), leftover=config.get("leftover", "flush"),
    noise_scale=config.get("noise_scale"), log_dir=config.get("log_dir"))
backup = tfaccum.BackupAndRestore(config["backup_dir"], save_freq=config.get("save_freq", 5),
                                  double_checkpoint=config.get("double_checkpoint", False))
kill = config.get("kill")  # {"at": global micro-batch, "during": "batch"|"save"|"flush"}


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt(keras.callbacks.Callback):
    """Counts the micro-batches this process trained; kills itself at the one named."""

    seen = 0

    def on_train_batch_end(self, batch, logs=None):
        KillAt.seen += 1
        if kill and kill["during"] == "batch" and KillAt.seen == kill["at"]:
            die()
        if kill and kill["during"] == "sigterm" and KillAt.seen == kill["at"]:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice: fit returns


if kill and kill["during"] == "save":  # after the new file is written, before it replaces the last
    write = backup_files.BackupFiles.write

    def write_then_die(self, meta, arrays):
        if KillAt.seen >= kill["at"]:
            replace = os.replace
            os.replace = lambda *a: die()
            write(self, meta, arrays)
            os.replace = replace
        return write(self, meta, arrays)

    backup_files.BackupFiles.write = write_then_die
if kill and kill["during"] == "flush":  # in the middle of a partial window's update
    end_epoch = tfaccum.GradientAccumulationCallback._end_epoch

    def end_then_die(self):
        if KillAt.seen >= kill["at"]:
            self.hook.flush()
            die()
        return end_epoch(self)

    tfaccum.GradientAccumulationCallback._end_epoch = end_then_die

callbacks = [accumulation, backup, KillAt()]
if config.get("backup_first"):
    callbacks = [backup, accumulation, KillAt()]
history = model.fit(**data, epochs=config.get("epochs", 3), shuffle=False, verbose=0, callbacks=callbacks)
if backup.preempted:
    sys.exit(3)
counters = accumulation.counters
np.savez(config["out"], *model.get_weights(),
         logs=json.dumps({k: v[-1] for k, v in history.history.items()}),
         iterations=int(_keras.variable_numpy(model.optimizer.iterations)),
         counters=json.dumps(counters.__dict__ if hasattr(counters, "__dict__") else
                             dict(counters)),
         noise_scale=np.asarray(np.nan if accumulation.noise_scale is None
                                else accumulation.noise_scale))
