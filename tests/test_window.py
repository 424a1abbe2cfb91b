"""The window state, its named counts, and the observer protocol."""

import numpy as np
import pytest
import tensorflow as tf

from reference import make_data
from reference import make_model

from tfaccum import AccumulationHook
from tfaccum.observing import WindowObserver
from tfaccum.backend.tensorflow.accumulators import Accumulators
from tfaccum.counts import TOTAL_COUNTS
from tfaccum.counts import WINDOW_COUNTS
from tfaccum.backend.tensorflow.counter_variable import CounterVariable

pytestmark = pytest.mark.backend(
    "tensorflow",
    reason="TensorFlow's window state in variables")


def test_counts_are_read_and_written_by_name():
    counts = CounterVariable(tf.distribute.get_strategy())
    assert counts.names == WINDOW_COUNTS + TOTAL_COUNTS
    counts.add(counts.delta(micro_steps=3, window_samples=8))
    counts.add(counts.delta(micro_steps=1, optimizer_steps=1))
    values = counts.numpy()
    assert values["micro_steps"] == 4 and values["window_samples"] == 8
    assert values["optimizer_steps"] == 1 and values["flushes"] == 0
    assert int(counts.read()["micro_steps"]) == 4
    with pytest.raises(KeyError, match="micro_step"):
        counts.delta(micro_step=1)
    counts.zero()
    assert set(counts.numpy().values()) == {0}


def test_window_adds_weighted_dense_and_sparse_gradients():
    window = Accumulators(tf.distribute.get_strategy())
    dense_variable = tf.Variable(tf.zeros((2,)))
    table = tf.Variable(tf.zeros((5, 2)))
    sparse = tf.IndexedSlices(tf.ones((2, 2)), tf.constant([1, 1]), tf.constant([5, 2]))
    grads = [tf.constant([1.0, 2.0]), sparse]
    window.track(grads, [dense_variable, table])
    window.add(grads, [dense_variable, table], weight=tf.constant(3, tf.int64))
    window.add([tf.constant([0.5, 0.5]), tf.IndexedSlices(
        tf.fill((1, 2), 2.0), tf.constant([4]), tf.constant([5, 2]))],
        [dense_variable, table], weight=tf.constant(1, tf.int64))
    dense, rows = window.gradients(denominator=tf.constant(4, tf.int64))
    np.testing.assert_allclose(dense, [(3 + 0.5) / 4, (6 + 0.5) / 4])
    # The rows of both micro-batches, weighted, in one IndexedSlices.
    assert isinstance(rows, tf.IndexedSlices)
    np.testing.assert_array_equal(rows.indices, [1, 1, 4])
    np.testing.assert_allclose(rows.values, [[0.75, 0.75], [0.75, 0.75], [0.5, 0.5]])
    np.testing.assert_allclose(tf.convert_to_tensor(rows)[1], [1.5, 1.5])
    window.reset()
    dense, rows = window.gradients()
    assert float(tf.reduce_sum(dense)) == 0 and rows.indices.shape[0] == 0


def test_dense_window_sums_sparse_rows():
    window = Accumulators(tf.distribute.get_strategy(), sparse_rows=False)
    table = tf.Variable(tf.zeros((5, 2)))
    sparse = tf.IndexedSlices(tf.ones((2, 2)), tf.constant([1, 1]), tf.constant([5, 2]))
    window.track([sparse], [table])
    window.add([sparse], [table])
    (grad,) = window.gradients()
    assert not isinstance(grad, tf.IndexedSlices)
    np.testing.assert_allclose(grad[1], [2.0, 2.0])


class Recorder(WindowObserver):
    """A fourth observer: it needs no change to the hook."""

    def __init__(self):
        self.calls = []
        with tf.init_scope():
            self.micro_samples = tf.Variable(tf.zeros((), tf.int64))
            self.applied = tf.Variable(tf.zeros((), tf.int64))
            self.resets = tf.Variable(tf.zeros((), tf.int64))

    def on_micro_step(self, state, step):
        self.micro_samples.assign_add(step.samples)
        return {}

    def on_apply(self, state, update):
        self.applied.assign_add(update.window["window_samples"])
        return {}

    def on_reset(self, state):
        self.resets.assign_add(1)
        return {}

    def on_install(self, hook):
        super().on_install(hook)
        self.calls.append("install")

    def on_uninstall(self, hook):
        self.calls.append("uninstall")


def test_a_new_observer_is_told_everything():
    x, y = make_data(n=40)
    model = make_model()
    recorder = Recorder()
    hook = AccumulationHook.watched_by(model, [recorder], accumulation_steps=2)
    assert recorder.calls == ["install"]
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 5 micro-batches
    assert int(recorder.micro_samples) == 40
    assert int(recorder.applied) == 32  # two windows of 16; the fifth is pending
    assert int(recorder.resets) == 2
    hook.drop()
    assert int(recorder.resets) == 3
    hook.remove()
    assert recorder.calls == ["install", "uninstall"]
    assert recorder in hook.observers


def test_hook_holds_one_window():
    model = make_model()
    hook = AccumulationHook(model, accumulation_steps=2)
    assert isinstance(hook.accumulators, Accumulators)
    assert hook.counts is hook.accumulators.counts
    hook.remove()


def test_nbytes_is_what_the_accumulators_hold():
    window = Accumulators(tf.distribute.get_strategy())
    table = tf.Variable(tf.zeros((1000, 4)))
    dense_variable = tf.Variable(tf.zeros((3, 5)))
    rows = tf.IndexedSlices(tf.ones((6, 4)), tf.range(6), tf.constant([1000, 4]))
    window.track([rows, tf.ones((3, 5))], [table, dense_variable])
    assert window.nbytes() == 15 * 4  # no rows yet
    window.add([rows, tf.ones((3, 5))], [table, dense_variable])
    window.add([rows, tf.ones((3, 5))], [table, dense_variable])
    assert window.nbytes() == 15 * 4 + 12 * (4 * 4 + 8)  # 12 rows of 4 floats and an int64
    dense = Accumulators(tf.distribute.get_strategy(), sparse_rows=False)
    dense.track([rows], [table])
    assert dense.nbytes() == 1000 * 4 * 4


def test_rows_made_ahead_are_taken_by_the_trace_which_then_makes_no_variable():
    window = Accumulators(tf.distribute.get_strategy())
    table, tied = tf.Variable(tf.zeros((1000, 4))), tf.Variable(tf.zeros((50, 4)))
    window.create_dense([table, tied], provisional=True)
    window.create_rows([table, tied])  # `tied` will get a dense gradient
    made = []

    def creator(next_creator, **kwargs):
        made.append(kwargs.get("name"))
        return next_creator(**kwargs)

    rows = tf.IndexedSlices(tf.ones((6, 4)), tf.range(6), tf.constant([1000, 4]))
    with tf.variable_creator_scope(creator):
        window.track([rows, tf.ones((50, 4))], [table, tied])
    assert made == []
    assert window.uses_rows(table) and not window.uses_rows(tied)
    window.add([rows, tf.ones((50, 4))], [table, tied])
    assert window.nbytes() == 6 * (4 * 4 + 8) + 50 * 4 * 4  # the table's dense copy is gone


def test_accumulators_made_ahead_follow_what_the_step_gives():
    # Made before the first trace (the step then traces once): the trace
    # keeps a dense one, gives a sparse gradient its rows, and drops one
    # whose variable gets no gradient (it would hold a copy for nothing).
    window = Accumulators(tf.distribute.get_strategy())
    table = tf.Variable(tf.zeros((1000, 4)))
    kernel = tf.Variable(tf.zeros((3, 5)))
    unused = tf.Variable(tf.zeros((7,)))
    window.create_dense([table, kernel, unused], provisional=True)
    assert window.nbytes() == (4000 + 15 + 7) * 4
    rows = tf.IndexedSlices(tf.ones((6, 4)), tf.range(6), tf.constant([1000, 4]))
    window.track([rows, tf.ones((3, 5)), None], [table, kernel, unused])
    assert window.uses_rows(table) and not window.uses_rows(kernel)
    assert not window.has_accumulator(unused)
    assert window.nbytes() == 15 * 4
    window.track([rows, tf.ones((3, 5)), None], [table, kernel, unused])  # a retrace
    assert window.nbytes() == 15 * 4
