"""Step tracing: a step's tape is recorded only where outputs may count differently.

A persistent tape around the model's own step keeps about one more copy of
the gradients alive (benchmarks/memory.py); one-loss models do without it,
and models with several losses keep the per-output split exact.
"""

import numpy as np
import pytest
import tensorflow as tf

import reference as oracle
from reference import keras

import tfaccum
from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow import step as step_module

pytestmark = pytest.mark.backend(
    "tensorflow",
    reason="TensorFlow's traced step (its graph, tapes and AutoGraph)")


class SubclassedTwoOutputs(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        y = self.dense(x)
        return y, y * 2.0


def two_outputs(loss):
    inputs = keras.Input((4,))
    a = keras.layers.Dense(3, name="a")(inputs)
    b = keras.layers.Dense(2, name="b")(inputs)
    model = keras.Model(inputs, {"a": a, "b": b})
    model.compile(optimizer="sgd", loss=loss)
    return model


def one_output(loss="mse"):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=loss)
    return model


@pytest.mark.keras3
@pytest.mark.parametrize("build, expected", [
    (lambda: one_output(), False),
    (lambda: one_output(["mse"]), False),
    (lambda: two_outputs({"a": "mse", "b": "mse"}), True),
    (lambda: two_outputs({"a": "mse", "b": None}), False),
    (lambda: two_outputs("mse"), True),  # one loss repeated per output
])
def test_several_losses_are_read_from_compile(build, expected):
    assert _keras_on_tf.may_hold_several_losses(build()) is expected


def test_a_subclassed_model_of_unknown_outputs_may_hold_several():
    model = SubclassedTwoOutputs()
    model.compile(optimizer="sgd", loss="mse")
    assert _keras_on_tf.may_hold_several_losses(model) is True


def test_an_uncompiled_loss_holds_none():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd")
    assert _keras_on_tf.may_hold_several_losses(model) is False


class CountingTapes:
    """Counts the persistent tapes tfaccum's step tracer opens."""

    def __init__(self, monkeypatch):
        self.persistent = 0
        original = tf.GradientTape

        def tape(*args, **kwargs):
            if kwargs.get("persistent"):
                self.persistent += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(step_module.tf, "GradientTape", tape)


def fit(model, x, y):
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False,
              callbacks=[tfaccum.GradientAccumulationCallback(accumulation_steps=2)])


@pytest.mark.keras3
def test_one_output_records_no_tape(monkeypatch):
    tapes = CountingTapes(monkeypatch)
    x, y = oracle.make_data(16, features=4)
    fit(one_output(), x, np.repeat(y, 3, axis=1))
    assert tapes.persistent == 0


@pytest.mark.keras3
def test_several_outputs_record_a_tape(monkeypatch):
    tapes = CountingTapes(monkeypatch)
    x, _ = oracle.make_data(16, features=4)
    fit(two_outputs({"a": "mse", "b": "mse"}), x,
        {"a": np.zeros((16, 3), "float32"), "b": np.ones((16, 2), "float32")})
    assert tapes.persistent >= 1


def _depends_on(tensor, sources):
    """Whether `tensor` is computed from any op of `sources` (data or control inputs)."""
    seen, stack = set(), [tensor.op]
    while stack:
        op = stack.pop()
        if op in sources:
            return True
        if op not in seen:
            seen.add(op)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
    return False


@pytest.mark.parametrize("spec", [
    tf.TensorSpec([8, 3]),
    tf.RaggedTensorSpec([8, None], tf.float32, 1, tf.int64),
    tf.SparseTensorSpec([8, 3], tf.float32),
], ids=["dense", "ragged", "sparse"])
def test_a_static_sample_count_still_waits_for_the_data(spec):
    """A micro-batch of static size (`drop_remainder=True`) is counted from its
    data, not as a constant: the step that finds no data at the end of a
    dataset of unknown length counts nothing (test_callback.py)."""
    def count(x):
        samples = step_module.count_samples((x,))
        graph = samples.graph
        inputs = {t.op for t in graph.inputs}
        assert _depends_on(samples, inputs), samples
        return samples

    function = tf.function(count)
    value = {tf.TensorSpec: tf.zeros([8, 3]),
             tf.RaggedTensorSpec: tf.ragged.constant([[1.0]] * 8),
             tf.SparseTensorSpec: tf.sparse.from_dense(tf.ones([8, 3]))}[type(spec)]
    assert int(function.get_concrete_function(spec)(value)) == 8
