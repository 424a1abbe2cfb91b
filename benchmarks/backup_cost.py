"""What `tfaccum.BackupAndRestore` costs: a backup's time and size, and training between backups.

The model of `memory.py`: Dense 3072-3072-3072-10 (19M weights, 72 MiB in
float32), Adam, micro-batches of 16, `accumulation_steps=4`, 512 samples,
`shuffle=False`. Each variant trains in a fresh process, `--repeats` rounds
in a new random order each; reported as the median and range over rounds:

- backup time: the seconds one backup takes (taken mid-window, the
  accumulators full), the median of a run's backups;
- backup size: the backup's bytes in parameter copies (Adam's model and
  optimizer are 3: weights and two moments);
- epoch time: the mean of epochs 2 to `--epochs`, over `none`'s in the same
  round.

    python benchmarks/backup_cost.py [--repeats 3] [--backend tensorflow]

Variants (each beside GradientAccumulationCallback(accumulation_steps=4)):
  none          no backup callback (the baseline)
  idle          tfaccum.BackupAndRestore with a save_freq never reached:
                what it costs between backups
  tfaccum       tfaccum.BackupAndRestore(save_freq=9): backups mid-window (the
                last one too: what its size is read from)
  keras         keras.callbacks.BackupAndRestore(save_freq=9): Keras' own,
                which holds no window (and resumes inexactly)
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from jax_backend import spread

VARIANTS = ("none", "idle", "tfaccum", "keras")


def run_variant(variant, args):
    """Trains `variant` in this process; prints its backups' times and size, and epoch times."""
    os.environ["KERAS_BACKEND"] = args.backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import tfaccum

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, args.width)).astype("float32")
    y = rng.integers(0, 10, args.samples)
    inputs = keras.Input((args.width,))
    hidden = keras.layers.Dense(args.width, activation="relu")(inputs)
    hidden = keras.layers.Dense(args.width, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    directory = tempfile.mkdtemp()
    saves = []
    callbacks = [tfaccum.GradientAccumulationCallback(accumulation_steps=args.steps)]
    if variant in ("idle", "tfaccum"):
        backup = tfaccum.BackupAndRestore(directory, save_freq=9 if variant == "tfaccum"
                                          else 10**9, delete_checkpoint=False)
        timed(backup, "_back_up", saves)
        callbacks.append(backup)
    elif variant == "keras":
        backup = keras.callbacks.BackupAndRestore(directory, save_freq=9,
                                                  delete_checkpoint=False)
        timed(backup, "_save_model", saves)
        callbacks.append(backup)
    times = []
    callbacks.append(keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda e, logs: times.append(-time.perf_counter()),
        on_epoch_end=lambda e, logs: times.append(times.pop() + time.perf_counter())))
    model.fit(x, y, batch_size=args.micro, epochs=args.epochs, shuffle=False, verbose=0,
              callbacks=callbacks)
    size = sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
               if not name.startswith(".") and not name.endswith(".bkp"))
    print(json.dumps({"saves": saves, "copies": size / weights, "epoch": statistics.mean(
        times[1:])}))


def timed(callback, method, saves):
    original = getattr(callback, method)

    def call(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        saves.append(time.perf_counter() - start)
        return result

    setattr(callback, method, call)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--backend", default="tensorflow")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        run_variant(args.variant, args)
        return
    rows = {variant: {"save": [], "copies": [], "epoch": []} for variant in VARIANTS}
    for _ in range(args.repeats):
        order = random.sample(VARIANTS, len(VARIANTS))
        measured = {}
        for variant in order:
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant],
                                 capture_output=True, text=True, check=True).stdout
            measured[variant] = json.loads(out.strip().splitlines()[-1])
        for variant, result in measured.items():
            row = rows[variant]
            if result["saves"]:
                row["save"].append(statistics.median(result["saves"]))
                row["copies"].append(result["copies"])
            row["epoch"].append(result["epoch"] / measured["none"]["epoch"])
    print(f"Backups on {args.backend}: 19M-weight MLP, Adam, micro-batches of {args.micro}, "
          f"accumulation_steps={args.steps}, {args.repeats} rounds; median (range)\n")
    print("| variant | backup time (s) | backup size (parameter copies) | epoch time / none |")
    print("|---|---|---|---|")
    for variant in VARIANTS:
        row = rows[variant]
        save = spread(row["save"]) if row["save"] else "-"
        copies = spread(row["copies"]) if row["copies"] else "-"
        print(f"| {variant} | {save} | {copies} | {spread(row['epoch'])} |")


if __name__ == "__main__":
    main()
