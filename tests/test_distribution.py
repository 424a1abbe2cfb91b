"""Accumulation under tf.distribute.MirroredStrategy on two logical CPUs, graph mode."""

import re

import numpy as np
import pytest
import tensorflow as tf

from reference import KERAS
from reference import compare
from reference import keras
from reference import make_data
from reference import make_model
from reference import max_weight_diff
from reference import mirrored
from test_noise_scale import exact_noise_scale
from test_noise_scale import frozen_linear_model
from test_noise_scale import regression
from test_nonfinite import loss_scale
from test_nonfinite import poisoned_data
from test_nonfinite import scaled_adam
from test_summary import global_norm
from test_summary import gradients
from reference import read_run
from test_summary import values

from tfaccum import dashboard_schema
from tfaccum import GradientAccumulationCallback
from tfaccum import install_accumulation_hook

pytestmark = pytest.mark.backend(
    "tensorflow",
    reason="tf.distribute strategies and workers; JAX's DataParallel is tested in test_jax.py")

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


def fit_mirrored(optimizer, x, y, strategy=None, sample_weight=None, epochs=3, leftover="flush",
                 left_out=(), **callback_kwargs):
    """Two replicas (micro-batches of 8, windows of 4) against one device's large batch."""
    return compare(lambda: make_model(optimizer=optimizer), x, y, micro=8, steps=4,
                   epochs=epochs, leftover=leftover, left_out=left_out,
                   sample_weight=sample_weight, strategy=strategy or mirrored(),
                   callback_kwargs=callback_kwargs)


# On tf_keras one even and one uneven last batch, each optimizer once.
@pytest.mark.parametrize("optimizer, n", [
    pytest.param("sgd_momentum", 100, id="even-last-batch-sgd_momentum"),
    pytest.param("adam", 100, id="even-last-batch-adam", marks=pytest.mark.once),
    pytest.param("sgd_momentum", 99, id="uneven-last-batch-sgd_momentum", marks=pytest.mark.once),
    pytest.param("adam", 99, id="uneven-last-batch-adam"),
])
def test_mirrored_equals_the_single_device_large_batch(optimizer, n):
    # 99 samples end in a micro-batch of 3, split 2 and 1 between the replicas:
    # weighting by samples must count both replicas' samples.
    x, y = make_data(n=n)
    pair = fit_mirrored(optimizer, x, y)
    assert pair.diff < TOL
    assert pair.moved(lambda: make_model(optimizer=optimizer)) > 1e-2
    model, callback = pair.model, pair.callback
    assert callback.optimizer_steps == 12 == int(model.optimizer.iterations.numpy())
    assert callback.micro_steps == 39 and callback.flushes == 3


def test_mirrored_with_sample_weight():
    x, y = make_data(n=99)
    sample_weight = np.linspace(0.1, 2.0, 99).astype("float32")
    assert fit_mirrored("adam", x, y, sample_weight=sample_weight).diff < TOL


@pytest.mark.parametrize("observed", [False, True], ids=["plain", "log_dir-and-noise-scale"])
@pytest.mark.once
def test_gradients_are_all_reduced_once_per_update(observed, tmp_path):
    # The dashboard and the noise scale add no reduction: they read the
    # first replica's micro-batches and the window the update reduces anyway.
    x, y = make_data()
    counter = CountingReduction()
    strategy = mirrored(counter)
    with strategy.scope():
        counter.count = tf.Variable(0, dtype=tf.int64, trainable=False)
    extra = dict(log_dir=str(tmp_path), noise_scale=True) if observed else {}
    pair = fit_mirrored("sgd", x, y, strategy=strategy, **extra)
    assert pair.diff < TOL
    callback = pair.callback
    if observed:
        assert callback.noise_scale is not None
        assert read_run(str(tmp_path))[0]
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


@pytest.mark.once  # the window's policies, not the optimizer's: alike on both
def test_leftover_drop_and_carry_under_mirrored():
    x, y = make_data()
    for leftover in ("drop", "carry"):
        pair = fit_mirrored("adam", x, y, leftover=leftover)
        assert pair.diff < TOL
        if leftover == "drop":
            assert pair.callback.dropped_micro_steps == 3
        else:
            assert pair.callback.optimizer_steps == 10 and pair.callback.flushes == 1


def test_skip_nonfinite_with_reduction_mean_is_refused():
    x, y = make_data(n=16)
    with pytest.raises(ValueError, match=(
            r"skip_nonfinite \(and mixed precision\) with several replicas leaves out one "
            r"replica's share .* Received: reduction='mean' with skip_nonfinite=True")):
        fit_mirrored("sgd", x, y, skip_nonfinite=True, reduction="mean")

CLIPPING = {
    "clipnorm": lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(0.05, clipvalue=0.01),
}


# clipvalue takes clipnorm's path in both optimizers (tf_keras: Keras 3 only).
@pytest.mark.parametrize("clipping", [
    pytest.param(name, marks=[pytest.mark.once] if name == "clipvalue" else [])
    for name in sorted(CLIPPING)])
def test_clipping_applies_to_the_all_reduced_window(clipping):
    # One device at the large batch clips the whole batch's gradient; plain
    # Keras 3 under MirroredStrategy clips each replica's share before summing.
    x, y = make_data(n=99)
    pair = fit_mirrored(CLIPPING[clipping], x, y)
    assert pair.diff < TOL
    reference = pair.reference
    unclipped = make_model(optimizer=lambda: keras.optimizers.SGD(0.05, momentum=0.9))
    unclipped.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert max_weight_diff(reference, unclipped) > 1e-2  # the clipping is active


@pytest.mark.once
def test_dashboard_series_are_those_of_the_global_window(tmp_path):
    # The same windows on one device (micro-batch 8, 4 per window) and on two
    # replicas (4 samples each per micro-batch): the same updates, written once.
    x, y = make_data()
    single = make_model(optimizer="adam")
    single.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[
        GradientAccumulationCallback(accumulation_steps=4, log_dir=str(tmp_path / "one"))])
    pair = fit_mirrored("adam", x, y, log_dir=str(tmp_path / "two"))
    model, callback = pair.model, pair.callback
    assert pair.diff < TOL and max_weight_diff(single, model) < TOL
    expected, _ = read_run(str(tmp_path / "one"))
    series, _ = read_run(str(tmp_path / "two"))
    whole_window = ["applied_gradient_norm", "window_micro_batches", "window_samples",
                    "window_items", "window_loss", "micro_steps", "skipped_updates",
                    "leftover/policy", "leftover/micro_batches", "leftover/samples"]
    for name in whole_window:
        np.testing.assert_allclose(values(series, name), values(expected, name), rtol=1e-5,
                                   err_msg=name)
    assert values(series, "window_samples") == [32, 32, 32, 4] * 3
    # Per variable (the layers' auto-numbered names differ; their order not).
    def per_variable(run):
        # Numbers compared as numbers: "dense_99" comes before "dense_100".
        tags = sorted((t for t in run if t.startswith(dashboard_schema.ACCUMULATOR_PREFIX)),
                      key=lambda t: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", t)])
        return [[float(v) for _, v in run[tag]] for tag in tags]

    assert len(per_variable(series)) == len(per_variable(expected)) == 4
    np.testing.assert_allclose(per_variable(series), per_variable(expected), rtol=1e-5)
    # Micro-batch norms: the first replica's shares (the first 4 samples of
    # each micro-batch of 8), with the first window's weights.
    initial = make_model(optimizer="adam")
    shares = [global_norm(gradients(initial, x[i:i + 4], y[i:i + 4])) for i in range(0, 32, 8)]
    assert values(series, "micro_norm_mean")[0] == pytest.approx(np.mean(shares), rel=1e-5)
    assert values(series, "micro_norm_max")[0] == pytest.approx(max(shares), rel=1e-5)
    assert callback.samples == 300 and callback.micro_steps == 39


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.once
def test_noise_scale_agrees_with_per_example_gradients(seed):
    """As on one device (test_noise_scale): within 35% of the exact value.

    Small batches: the first replica's 8 samples of each micro-batch of 16;
    big: the window of 8 such micro-batches, summed over both replicas.
    """
    x, y = regression()
    strategy = mirrored()
    with strategy.scope():
        model = frozen_linear_model()
    exact = exact_noise_scale(model, x, y)
    keras.utils.set_random_seed(100 + seed)
    callback = GradientAccumulationCallback(accumulation_steps=8)
    model.fit(x, y, batch_size=16, epochs=4, shuffle=True, verbose=0, callbacks=[callback])
    assert callback.estimator.micro_batch_size == 8
    assert callback.noise_scale == pytest.approx(exact, rel=0.35)


def test_mixed_precision_leaves_out_one_replicas_share(mixed_precision):
    # The window is then the large batch of the other 28 samples.
    # Sample 10 overflows in float16; in the second micro-batch of 8 it is in
    # the first replica's share (samples 8-11).
    x, y = poisoned_data(target=1e5)
    pair = fit_mirrored(scaled_adam, x, y, epochs=1,  # the first replica's half of the second
                        left_out=lambda epoch, index: set(range(8, 12)) if index == 1 else set())
    assert pair.diff < 1e-5
    model, callback = pair.model, pair.callback
    assert callback.hook.skip_nonfinite is True
    assert callback.nonfinite_skips == 1 and callback.optimizer_steps == 1
    assert callback.samples == 28 and callback.micro_steps == 4
    # Lowered once (from 2**8), alike on every replica.
    scale = loss_scale(model.optimizer)
    scale = getattr(scale, "value", scale)  # Keras 3: the tf.Variable inside
    if KERAS == "tf_keras":
        scale = model.optimizer._loss_scale.current_loss_scale
    scales = model.distribute_strategy.experimental_local_results(scale)
    assert [float(s.numpy()) for s in scales] == [2.0**7] * 2
    assert pair.updates == [list(range(0, 8)) + list(range(12, 32))]


# bfloat16 needs no loss scale: a dtype, alike on both (tf_keras: Keras 3 only).
@pytest.mark.parametrize("policy", [
    "mixed_float16", pytest.param("mixed_bfloat16", marks=pytest.mark.once)])
def test_mixed_precision_equals_one_device(policy):
    keras.mixed_precision.set_global_policy(policy)
    try:
        x, y = make_data()
        optimizer = scaled_adam if policy == "mixed_float16" else "adam"
        pair = fit_mirrored(optimizer, x, y)
        model, callback = pair.model, pair.callback
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert callback.nonfinite_skips == 0 and callback.optimizer_steps == 12
    # As on one device: low-precision forward passes round differently per
    # batch shape (float16: 1e-4, test_nonfinite; bfloat16, 8 bits of
    # mantissa: one device accumulating is 7.7e-4 from its large batch, two
    # replicas 8.2e-4).
    assert pair.diff < (1e-4 if policy == "mixed_float16" else 2e-3)
    assert max_weight_diff(make_model(optimizer=optimizer), model) > 1e-2


def test_a_window_left_out_on_every_replica_makes_no_update():
    x, y = make_data(n=16)
    y[:, 0] = np.inf
    pair = fit_mirrored("sgd", x, y, epochs=1, skip_nonfinite=True,
                        left_out=lambda epoch, index: set(range(16)))
    model, callback = pair.model, pair.callback
    assert pair.updates == [] and pair.ours == []
    assert callback.nonfinite_skips == 4 and callback.optimizer_steps == 0
    assert int(model.optimizer.iterations.numpy()) == 0
    assert max_weight_diff(make_model(optimizer="sgd"), model) == 0


@pytest.mark.keras3
def test_an_optimizer_without_keras_reduction_is_refused_by_name():
    from tfaccum.backend.tensorflow import _keras_on_tf

    class Unknown:
        pass

    with pytest.raises(RuntimeError, match=(
            r"This Keras version's optimizer has no `_all_reduce_sum_gradients`; tfaccum "
            r"cannot apply a window across replicas with it. Received: Unknown from Keras 3\.")):
        with _keras_on_tf.Keras3OnTf.own_reduction_off(Unknown()):
            pass


@pytest.mark.parametrize("reduction", ["auto", "mean"])
def test_a_strategy_of_one_replica_equals_the_large_batch(reduction):
    # MirroredStrategy on one GPU (or a CPU): its step runs in a replica
    # context, where Keras' update calls `merge_call`, as with several.
    x, y = make_data(n=100)
    cpu = tf.config.list_logical_devices("CPU")[0].name
    one = tf.distribute.MirroredStrategy([cpu])
    assert one.num_replicas_in_sync == 1
    pair = fit_mirrored("adam", x, y, strategy=one, reduction=reduction, skip_nonfinite=True)
    assert pair.diff < TOL
    assert pair.moved(lambda: make_model(optimizer="adam")) > 1e-2
    assert pair.callback.optimizer_steps == 12
