"""Accumulation under tf.distribute.MirroredStrategy on two logical CPUs, graph mode."""

from conftest import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import make_data
from conftest import make_model
from conftest import max_weight_diff

from tfaccum import GradientAccumulationCallback
from tfaccum import install_accumulation_hook

TOL = 1e-5


class CountingReduction(tf.distribute.ReductionToOneDevice):
    """Cross-device reduction that counts, at run time, how often it runs:
    `count` the batched ones (gradients), `single` one-value ones (counters)."""

    def __init__(self):
        super().__init__()
        self.count = self.single = None

    @staticmethod
    def _after(reduced, counter):
        if counter is not None:
            with tf.control_dependencies(tf.nest.flatten(
                    [v.values if hasattr(v, "values") else v for v in tf.nest.flatten(reduced)])):
                counter.assign_add(1)
        return reduced

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        return self._after(super().batch_reduce_implementation(
            reduce_op, value_destination_pairs, options), self.count)

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self._after(super().reduce_implementation(
            reduce_op, per_replica_value, destinations, options), self.single)


def mirrored(cross_device_ops=None):
    """Two replicas. Reductions go through one device: TensorFlow's collective
    ops (the CPU default) clash between several strategies in one process,
    with or without tfaccum."""
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    assert len(devices) == 2, "conftest configures two logical CPUs"
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=cross_device_ops or tf.distribute.ReductionToOneDevice())


def fit_mirrored(optimizer, x, y, strategy=None, sample_weight=None, **callback_kwargs):
    strategy = strategy or mirrored()
    with strategy.scope():
        model = make_model(optimizer=optimizer)
    callback = GradientAccumulationCallback(accumulation_steps=4, **callback_kwargs)
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              sample_weight=sample_weight, callbacks=[callback])
    return model, callback


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
@pytest.mark.parametrize("n", [100, 99], ids=["even-last-batch", "uneven-last-batch"])
def test_mirrored_equals_the_single_device_large_batch(optimizer, n):
    # 99 samples end in a micro-batch of 3, split 2 and 1 between the replicas:
    # weighting by samples must count both replicas' samples.
    x, y = make_data(n=n)
    reference = make_model(optimizer=optimizer)
    reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    model, callback = fit_mirrored(optimizer, x, y)
    assert max_weight_diff(reference, model) < TOL
    assert max_weight_diff(make_model(optimizer=optimizer), model) > 1e-2
    assert callback.optimizer_steps == 12 == int(model.optimizer.iterations.numpy())
    assert callback.micro_steps == 39 and callback.flushes == 3


def test_mirrored_with_sample_weight():
    x, y = make_data(n=99)
    sample_weight = np.linspace(0.1, 2.0, 99).astype("float32")
    reference = make_model(optimizer="adam")
    reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0, sample_weight=sample_weight)
    model, _ = fit_mirrored("adam", x, y, sample_weight=sample_weight)
    assert max_weight_diff(reference, model) < TOL


def test_gradients_are_all_reduced_once_per_update():
    x, y = make_data()
    counter = CountingReduction()
    strategy = mirrored(counter)
    with strategy.scope():
        counter.count = tf.Variable(0, dtype=tf.int64, trainable=False)
    model, callback = fit_mirrored("sgd", x, y, strategy=strategy)
    # Keras reduces the gradients (one batch) per update; the 39 micro-steps
    # reduce nothing: replicas decide that a window is full each on its own.
    assert callback.micro_steps == 39 and callback.optimizer_steps == 12
    assert int(counter.count.numpy()) == 12
    # Plain Keras, for contrast: one reduction per batch.
    plain_counter = CountingReduction()
    plain = mirrored(plain_counter)
    with plain.scope():
        plain_counter.count = tf.Variable(0, dtype=tf.int64, trainable=False)
        model = make_model(optimizer="sgd")
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    assert int(plain_counter.count.numpy()) == 39


def test_a_micro_step_reduces_nothing_more_than_a_plain_step():
    # Deciding that a window is full needs no reduction: each replica (and,
    # across machines, each worker) keeps its own position in the window.
    x, y = make_data(n=8)
    counter = CountingReduction()
    strategy = mirrored(counter)
    with strategy.scope():
        counter.count = tf.Variable(0, dtype=tf.int64, trainable=False)
        counter.single = tf.Variable(0, dtype=tf.int64, trainable=False)
        model = make_model(optimizer="sgd")

    def reductions_in_one_step():
        before = int(counter.count.numpy()), int(counter.single.numpy())
        model.train_on_batch(x, y)
        return int(counter.count.numpy()) - before[0], int(counter.single.numpy()) - before[1]

    reductions_in_one_step()  # traces
    plain = reductions_in_one_step()
    assert plain[0] == 1  # plain Keras reduces the gradients every step
    hook = install_accumulation_hook(model, accumulation_steps=4)
    reductions_in_one_step()  # traces
    assert reductions_in_one_step() == (0, 0)  # a micro-step reduces nothing
    assert reductions_in_one_step() == (0, 0)
    gradients, others = reductions_in_one_step()  # the fourth updates
    assert gradients == 1 and others >= plain[1]
    assert hook.optimizer_steps == 1
    hook.remove()


def test_leftover_drop_and_carry_under_mirrored():
    x, y = make_data()
    for leftover in ("drop", "carry"):
        model, callback = fit_mirrored("adam", x, y, leftover=leftover)
        if leftover == "drop":
            reference = make_model(optimizer="adam")
            reference.fit(x[:96], y[:96], batch_size=32, epochs=3, shuffle=False, verbose=0)
            assert max_weight_diff(reference, model) < TOL
            assert callback.dropped_micro_steps == 3
        else:
            assert callback.optimizer_steps == 10 and callback.flushes == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(log_dir="unused"), r"summaries \(log_dir\) with several replicas is not supported yet"),
        (dict(skip_nonfinite=True), r"skip_nonfinite \(and mixed precision\) with several replicas"),
        (dict(noise_scale=True), r"the noise scale with several replicas is not supported yet"),
    ],
)
def test_unsupported_combinations_are_refused(kwargs, message):
    x, y = make_data(n=16)
    with pytest.raises(ValueError, match=message):
        fit_mirrored("sgd", x, y, **kwargs)


CLIPPING = {
    "clipnorm": lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(0.05, clipvalue=0.01),
}


@pytest.mark.parametrize("clipping", sorted(CLIPPING))
def test_clipping_applies_to_the_all_reduced_window(clipping):
    # One device at the large batch clips the whole batch's gradient; plain
    # Keras 3 under MirroredStrategy clips each replica's share before summing.
    x, y = make_data(n=99)
    reference = make_model(optimizer=CLIPPING[clipping])
    reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    model, _ = fit_mirrored(CLIPPING[clipping], x, y)
    assert max_weight_diff(reference, model) < TOL
    unclipped = make_model(optimizer=lambda: keras.optimizers.SGD(0.05, momentum=0.9))
    unclipped.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert max_weight_diff(reference, unclipped) > 1e-2  # the clipping is active
