"""A dual encoder with in-batch negatives over the whole accumulation window.

Offline: scikit-learn's handwritten digits (they ship inside the package).
Each image is cut in two: the query is its top half, the document its bottom
half, and the task is retrieval: find each held-out top half's own bottom
half among all held-out bottom halves. The loss is an in-batch softmax: every
other bottom half of the batch is a negative, so the batch size is the
number of negatives.

Four runs from the same weights, the same samples and the same memory per
step (micro-batches of 16):

- plain micro-batches: 15 negatives per query;
- ordinary accumulation, 8 micro-batches per update: still 15 negatives
  (each micro-batch's loss is its own), averaged over 8;
- window-wide accumulation (`tfaccum.InBatchSoftmax`): 127 negatives,
  exactly the batch of 128;
- the batch of 128 itself, plainly: the reference the window-wide run equals.

    python examples/dual_encoder_digits.py [--epochs 20] [--logdir runs/retrieval]

It runs on Keras 3's TensorFlow or JAX backend (KERAS_BACKEND), and on tf_keras.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tfaccum  # noqa: E402

MICRO_BATCH = 16
WINDOW = 8


def load_halves(test=297):
    """Top and bottom halves of each digit, scaled to [0, 1]; the last `test` held out."""
    images = load_digits().images.astype("float32") / 16.0
    top = images[:, :4, :].reshape(len(images), -1)
    bottom = images[:, 4:, :].reshape(len(images), -1)
    order = np.random.default_rng(0).permutation(len(images))
    top, bottom = top[order], bottom[order]
    return (top[:-test], bottom[:-test]), (top[-test:], bottom[-test:])


def tower(name):
    return keras.Sequential([
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(32),
    ], name=name)


def dual_encoder(loss, seed=0):
    """Two towers, their embeddings side by side: `[query | document]`."""
    keras.utils.set_random_seed(seed)
    query, document = keras.Input((32,), name="top"), keras.Input((32,), name="bottom")
    queries, documents = tower("query_tower"), tower("document_tower")
    outputs = keras.layers.Concatenate()([queries(query), documents(document)])
    model = keras.Model([query, document], outputs)
    # On TensorFlow, XLA's fixed shapes cannot hold the window's growing buffers.
    model.compile(keras.optimizers.Adam(2e-3), loss=loss,
                  jit_compile=keras.backend.backend() != "tensorflow")
    return model, queries, documents


def retrieval_accuracy(queries, documents, top, bottom):
    """How often a top half's nearest bottom half (cosine) is its own."""
    q, d = (keras.ops.convert_to_numpy(tower(x)) for tower, x in ((queries, top),
                                                                  (documents, bottom)))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    d /= np.linalg.norm(d, axis=-1, keepdims=True)
    nearest = np.argmax(q @ d.T, axis=1)
    return float(np.mean(nearest == np.arange(len(top))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--logdir", default=None, help="Accumulation dashboard summaries")
    args = parser.parse_args()
    (top, bottom), (test_top, test_bottom) = load_halves()
    x, y = [top, bottom], np.zeros(len(top), "float32")  # the labels are the pairing itself
    window_loss = tfaccum.InBatchSoftmax(temperature=0.1)

    def per_micro_batch(y_true, y_pred):  # the same loss, as an ordinary Keras loss
        return window_loss.call(y_true, y_pred)

    runs = {
        "plain micro-batches of 16": (per_micro_batch, MICRO_BATCH, None),
        "ordinary accumulation, 8 x 16": (per_micro_batch, MICRO_BATCH, dict()),
        "window-wide accumulation, 8 x 16": (window_loss, MICRO_BATCH, dict(log_dir=args.logdir)),
        "batch of 128 (reference)": (window_loss, MICRO_BATCH * WINDOW, None),
    }
    results = {}
    print(f"{len(top)} training pairs, {len(test_top)} held-out pairs; "
          f"{args.epochs} epochs each, Adam 2e-3")
    for name, (loss, batch_size, options) in runs.items():
        model, queries, documents = dual_encoder(loss)
        callbacks = []
        if options is not None:
            callbacks.append(tfaccum.GradientAccumulationCallback(
                accumulation_steps=WINDOW, **{k: v for k, v in options.items() if v}))
        history = model.fit(x, y, batch_size=batch_size, epochs=args.epochs, shuffle=False,
                            verbose=0, callbacks=callbacks)
        accuracy = retrieval_accuracy(queries, documents, test_top, test_bottom)
        results[name] = model
        print(f"  {name:34s} retrieval top-1 {accuracy:6.1%}   "
              f"last epoch's loss {history.history['loss'][-1]:.4f}")
    ours = results["window-wide accumulation, 8 x 16"].get_weights()
    theirs = results["batch of 128 (reference)"].get_weights()
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, theirs))
    print(f"window-wide accumulation vs the batch of 128: largest weight difference {diff:.1e}")


if __name__ == "__main__":
    main()
