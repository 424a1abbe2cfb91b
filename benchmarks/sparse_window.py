"""Memory and time of a sparse (embedding) window: rows vs a dense accumulator.

With `sparse_gradients="rows"` (the default) the window keeps every row its
micro-batches looked up, so the optimizer receives the large batch's own
`IndexedSlices`; with `"dense"` it scatter-adds them into an accumulator the
size of the embedding table. This measures, in one run, the accumulator
bytes held when the window is fullest (read from the hook's variables, not
estimated) and the epoch time of each, for a small and a large vocabulary.

    python benchmarks/sparse_window.py [--rounds 5]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfaccum import GradientAccumulationCallback  # noqa: E402


def build(vocabulary, dim, length):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((length,), dtype="int32"),
        keras.layers.Embedding(vocabulary, dim),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


class WindowBytes(keras.callbacks.Callback):
    """The accumulators' bytes after each batch; keeps the largest."""

    def __init__(self, callback):
        super().__init__()
        self.callback = callback
        self.peak = 0

    def on_train_batch_end(self, batch, logs=None):
        self.peak = max(self.peak, self.callback.hook.window.nbytes())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    y = rng.normal(size=(args.samples, 1)).astype("float32")
    window_rows = args.steps * args.micro_batch * args.length
    print(f"Embedding dim {args.dim}, {args.length} tokens per sequence, micro-batch "
          f"{args.micro_batch}, accumulation_steps {args.steps}: a full window looks up "
          f"{window_rows} rows. Median epoch time over {args.rounds} alternating rounds.")
    print()
    print("| vocabulary | sparse_gradients | accumulator MB at the fullest | epoch s |")
    print("|---:|---|---:|---:|")
    for vocabulary in (2_000, 100_000):
        x = rng.integers(0, vocabulary, size=(args.samples, args.length))
        runs = {}
        for mode in ("rows", "dense"):
            model = build(vocabulary, args.dim, args.length)
            callback = GradientAccumulationCallback(
                accumulation_steps=args.steps, sparse_gradients=mode, noise_scale=False)
            probe = WindowBytes(callback)
            runs[mode] = (model, callback, probe, [])
        for round_ in range(args.rounds + 1):  # round 0 traces
            for mode, (model, callback, probe, times) in runs.items():
                start = time.perf_counter()
                model.fit(x, y, batch_size=args.micro_batch, epochs=1, verbose=0,
                          callbacks=[callback, probe])
                if round_:
                    times.append(time.perf_counter() - start)
        for mode, (_, _, probe, times) in runs.items():
            print(f"| {vocabulary:,} | {mode} | {probe.peak / 2**20:.2f} | "
                  f"{statistics.median(times):.3f} |")


if __name__ == "__main__":
    main()
