"""Ops in one micro-step's graph: plain training, Keras' accumulation, tfaccum.

Traces the model's `train_step` in a `tf.function`, as `fit` does, once per
variant, and counts the nodes of its graph and of the functions it calls,
apart from the branches a micro-step skips (the larger branch of each
`tf.cond`: the window's end, taken once per window, with the optimizer's
update). A deterministic measure of
the work a micro-step adds, where timings on a shared machine cannot resolve
a few percent: on the CPU each op costs microseconds whatever its size, so
on a model of millisecond steps the count is the overhead. Constants and
captured variables are nodes too.

    python benchmarks/step_ops.py [--width 64] [--micro-batch 8]

Variants (Adam, `accumulation_steps=4`, a loss averaged per sample):
  plain      no accumulation (its update runs every step)
  keras      Keras' optimizer(gradient_accumulation_steps=4)
  tfaccum    tfaccum's defaults (reduction="auto", the noise scale on)
  no-noise   the same without the noise scale
  samples    reduction="samples", the noise scale on (no item counting)
"""

import argparse
import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfaccum  # noqa: E402
from tfaccum.noise_scale import NoiseScaleEstimator  # noqa: E402

VARIANTS = ("plain", "keras", "tfaccum", "no-noise", "samples")
FEATURES, STEPS = 32, 4


def build(variant, width):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(10)])
    steps = STEPS if variant == "keras" else None
    model.compile(optimizer=keras.optimizers.Adam(1e-3, gradient_accumulation_steps=steps),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if variant in ("tfaccum", "no-noise", "samples"):
        # What the callback installs with these arguments (no BatchNormalization here).
        observers = () if variant == "no-noise" else (NoiseScaleEstimator(),)
        tfaccum.AccumulationHook.watched_by(
            model, observers, accumulation_steps=STEPS,
            reduction="samples" if variant == "samples" else "auto")
    return model


def count(variant, width, micro_batch):
    """(nodes a micro-step runs, nodes of the window's end or `None`)."""
    per_step, window_end = micro_step_ops(variant, width, micro_batch)
    return sum(per_step.values()), window_end


def micro_step_ops(variant, width, micro_batch):
    """(`Counter` of the op types a micro-step runs, nodes of the window's end or `None`)."""
    model = build(variant, width)
    step = tf.function(model.train_step)
    graph = step.get_concrete_function(
        (tf.TensorSpec([micro_batch, FEATURES]), tf.TensorSpec([micro_batch], tf.int32))
    ).graph.as_graph_def()
    library = {function.signature.name: function.node_def for function in graph.library.function}
    window_end = []

    def nodes(defs, ops):
        for node in defs:
            ops[node.op] += 1
            called = [node.attr[a].func.name for a in ("f", "then_branch", "else_branch")
                      if a in node.attr and node.attr[a].func.name]
            if node.op in ("If", "StatelessIf"):
                # The larger branch is the window's end; the other runs every micro-step.
                branches = sorted((nodes(library[name], collections.Counter())
                                   for name in called), key=lambda b: sum(b.values()))
                window_end.append(sum(branches[-1].values()))
                for branch in branches[:-1]:
                    ops.update(branch)
            else:
                for name in called:
                    nodes(library[name], ops)
        return ops

    per_step = nodes(graph.node, collections.Counter())
    return per_step, (sum(window_end) if window_end else None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()
    print(f"MLP {FEATURES}-{args.width}-10, Adam, micro-batch {args.micro_batch}, "
          f"accumulation_steps={STEPS}: graph nodes of one traced train step\n")
    print("| variant | nodes per micro-step | nodes in branches it skips (the window's end) |")
    print("|---|---:|---:|")
    for variant in VARIANTS:
        per_step, window_end = count(variant, args.width, args.micro_batch)
        print(f"| {variant} | {per_step} | {'-' if window_end is None else window_end} |",
              flush=True)


if __name__ == "__main__":
    main()
