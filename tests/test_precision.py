"""bfloat16 accumulators: half the memory, the float32 sum on average.

How far they stray over hundreds of updates of a real model is measured
by benchmarks/precision.py (benchmarks/RESULTS.md, docs/reduced-precision.md);
here, on every backend: the rounding is unbiased, the accumulators are
bfloat16, training stays close to float32 accumulation where
round-to-nearest drifts, and what cannot meet is refused by name.
"""

import ml_dtypes
import numpy as np
import pytest

import reference as oracle
from reference import BACKEND
from reference import keras
from reference import max_diff
from reference import not_on_torch

from tfaccum import GradientAccumulationCallback

if BACKEND == "tensorflow":
    import tensorflow as tf

    from tfaccum.backend.tensorflow import accumulators
    from tfaccum.backend.tensorflow import precision

    def rounded(values, seed):
        """float32 `values` rounded stochastically by the backend, as NumPy float32."""
        tf.random.set_seed(seed)
        return tf.cast(precision.stochastic_round(tf.constant(values, tf.float32)),
                       tf.float32).numpy()
else:
    import jax.numpy as jnp

    from tfaccum.backend.jax import precision as jax_precision

    def rounded(values, seed):
        x = jnp.asarray(values, jnp.float32)
        return np.asarray(jax_precision.stochastic_round(x, seed).astype(jnp.float32))

tensorflow_only = pytest.mark.backend(
    "tensorflow", reason="TensorFlow's accumulator variables (JAX keeps arrays, rounded whole "
    "by XLA in one fused pass)")


def test_stochastic_rounding_is_unbiased_and_keeps_what_bfloat16_holds():
    between = 1.0 + 2.0**-10  # a quarter of the way from 1 to the next bfloat16 (1 + 2**-7)
    up = rounded(np.full([200_000], between), seed=0)
    assert set(np.unique(up)) == {1.0, 1.0 + 2.0**-7}
    assert abs(float(up.mean()) - between) < 2e-5
    negative = rounded(np.full([200_000], -between), seed=1)
    assert abs(float(negative.mean()) + between) < 2e-5
    exact = np.float32([0.0, -0.0, 1.0, -2.5, 2.0**127, 3.3895314e38, np.inf, -np.inf])
    assert np.array_equal(rounded(exact, seed=2), exact)
    assert np.isnan(rounded([np.nan], seed=3)[0])


def test_a_long_window_of_small_gradients_keeps_their_sum():
    """Adding 1e-3 a thousand times to 1: nearest rounding loses every one."""
    held = np.ones([4096], np.float32)
    for step in range(1000):
        held = rounded(held + np.float32(1e-3), seed=step)
    assert abs(float(held.mean()) - 2.0) < 0.01, held.mean()
    nearest = np.ones([4096], np.float32)
    for _ in range(1000):  # rounded to the nearest bfloat16
        nearest = (nearest + np.float32(1e-3)).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert float(nearest.mean()) == 1.0


@pytest.mark.keras3
def test_a_long_window_applies_its_whole_sum():
    """512 equal micro-batch gradients: a bfloat16 sum rounded to the nearest
    stops growing at 256 of them (each is then less than half a unit in the
    last place of the sum), and the update is half the large batch's."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(
        64, kernel_initializer="zeros", bias_initializer="zeros")])
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    x, y = np.zeros((512, 1), "float32"), np.full((512, 64), 0.3, "float32")
    callback = GradientAccumulationCallback(accumulation_steps=512, accumulator_dtype="bfloat16",
                                            noise_scale=False)
    model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert callback.optimizer_steps == 1
    bias = model.get_weights()[1]
    large_batch = 2 * 0.3 / 64  # SGD(1.0) on the mean gradient
    assert abs(bias.mean() / large_batch - 1) < 0.03, bias.mean() / large_batch


@tensorflow_only
def test_bfloat16_sum_adds_in_float32_and_rounds_once():
    variable = tf.Variable(tf.ones([4096], tf.bfloat16))
    sums = precision.BFloat16Sum(variable)
    tf.random.set_seed(1)
    for _ in range(1000):
        sums.add(tf.fill([4096], 1e-3), None)
    mean = float(tf.reduce_mean(sums.read()))
    assert abs(mean - 2.0) < 0.01, mean


def build(seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


class AccumulatorBytes(keras.callbacks.Callback):
    """What the window's accumulators hold, read at the first epoch's end."""

    def __init__(self, accumulation):
        super().__init__()
        self.accumulation = accumulation
        self.nbytes = None

    def on_epoch_end(self, epoch, logs=None):
        hook = self.accumulation.hook
        if self.nbytes is None:
            self.nbytes = (hook.accumulators.nbytes() if BACKEND == "tensorflow"
                           else sum(a.nbytes for a in hook._accumulators))


def fit(accumulator_dtype, steps=16, **compile_kwargs):
    x, y = oracle.make_data(256, features=8)
    model = build()
    if compile_kwargs:
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", **compile_kwargs)
    callback = GradientAccumulationCallback(accumulation_steps=steps,
                                            accumulator_dtype=accumulator_dtype)
    callback.held = AccumulatorBytes(callback)
    keras.utils.set_random_seed(0)  # the roundings' draws
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
              callbacks=[callback, callback.held])
    return model, callback


@pytest.mark.keras3
def test_bfloat16_accumulators_hold_half_and_train_close_to_float32():
    full, full_callback = fit("float32")
    half, half_callback = fit("bfloat16")
    assert half_callback.held.nbytes * 2 == full_callback.held.nbytes == 4 * (8 * 32 + 32 + 33)
    assert half_callback.optimizer_steps == full_callback.optimizer_steps == 8
    diff = max_diff(half.get_weights(), full.get_weights())
    assert 0 < diff < 1e-3, diff


@pytest.mark.keras3
@pytest.mark.parametrize("compile_kwargs", [
    pytest.param(dict(jit_compile=True), marks=not_on_torch("jit_compile")),
    pytest.param(dict(steps_per_execution=3), marks=not_on_torch("steps_per_execution"))],
    ids=["jit_compile", "steps_per_execution"])
def test_bfloat16_in_compiled_steps(compile_kwargs):
    full, _ = fit("float32")
    half, callback = fit("bfloat16", **compile_kwargs)
    assert callback.optimizer_steps == 8
    assert max_diff(half.get_weights(), full.get_weights()) < 1e-2


@pytest.mark.backend("tensorflow", reason="MirroredStrategy (under JAX's DataParallel bfloat16 "
                     "is served: test_bfloat16_under_data_parallel)")
def test_bfloat16_is_refused_with_several_replicas():
    with oracle.mirrored().scope():
        model = build()
    x, y = oracle.make_data(16, features=8)
    callback = GradientAccumulationCallback(accumulation_steps=2, accumulator_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"accumulator_dtype='bfloat16'.*several replicas"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[callback])
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # a plain model again


@pytest.mark.backend("jax", reason="keras.distribution.DataParallel (under TensorFlow's "
                     "strategies it is refused: test_bfloat16_is_refused_with_several_replicas)")
def test_bfloat16_under_data_parallel():
    full, _ = fit("float32")
    with keras.distribution.DataParallel().scope():
        half, callback = fit("bfloat16")
    assert callback.optimizer_steps == 8
    assert callback.held.nbytes == 2 * 2 * (8 * 32 + 32 + 33)  # each device's partial sums
    diff = max_diff(half.get_weights(), full.get_weights())
    assert 0 < diff < 1e-3, diff


@pytest.mark.parametrize("value", ["float16", "bf16", np.float16, None, 16])
def test_bad_accumulator_dtype_is_named(value):
    with pytest.raises(ValueError, match=r"`accumulator_dtype` must be one of 'float32', "
                                         r"'bfloat16'\. Received: accumulator_dtype="):
        GradientAccumulationCallback(accumulation_steps=2, accumulator_dtype=value)


def test_the_option_is_in_repr_and_config():
    callback = GradientAccumulationCallback(accumulation_steps=2, accumulator_dtype="bfloat16")
    assert "accumulator_dtype='bfloat16'" in repr(callback)
    assert callback.get_config()["accumulator_dtype"] == "bfloat16"


def embedding_model(outputs=1):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(50, 8)(inputs)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    first = keras.layers.Dense(1, name="first")(hidden)
    if outputs == 1:
        model = keras.Model(inputs, first)
        loss = "mse"
    else:  # a per-token head masked by its own labels: its own channel
        tokens = keras.layers.Dense(3, name="tokens")(keras.layers.Embedding(
            50, 4, mask_zero=True)(inputs))
        model = keras.Model(inputs, {"first": first, "tokens": tokens})
        loss = {"first": "mse", "tokens": keras.losses.SparseCategoricalCrossentropy(
            from_logits=True)}
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    return model


@pytest.mark.keras3
@pytest.mark.parametrize("case", [
    "mixed_precision",
    "rows", "dense",
    pytest.param("two_outputs", marks=pytest.mark.backend(
        "tensorflow", "torch", reason="JAX's outputs counted apart meet bfloat16 in "
        "test_jax.py::test_outputs_that_count_differently_meet_the_other_options")),
    "log_dir"])
def test_bfloat16_meets_the_other_options(case, tmp_path, request):
    if case == "mixed_precision":
        request.getfixturevalue("mixed_precision")
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 50, (96, 6)).astype("int32")
    tokens[::5, 3:] = 0  # padding the per-token head masks out
    y = rng.normal(size=(96, 1)).astype("float32")
    outputs = 2 if case == "two_outputs" else 1
    if outputs == 2:
        y = {"first": y, "tokens": rng.integers(0, 3, (96, 6))}
    options = dict(sparse_gradients="dense" if case == "dense" else "rows")
    if case == "log_dir":
        options["log_dir"] = str(tmp_path)
    results = {}
    for dtype in ("float32", "bfloat16"):
        model = embedding_model(outputs)
        callback = GradientAccumulationCallback(accumulation_steps=8, accumulator_dtype=dtype,
                                                **options)
        model.fit(tokens, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                  callbacks=[callback])
        results[dtype] = (model.get_weights(), callback)
    (full, full_callback), (half, half_callback) = results["float32"], results["bfloat16"]
    assert half_callback.optimizer_steps == full_callback.optimizer_steps == 6
    assert oracle.all_finite(half)
    assert max_diff(half, full) < 1e-2, case
    if case == "log_dir":
        assert list(tmp_path.rglob("*.tfevents.*"))


@tensorflow_only
def test_a_large_variable_is_summed_in_slices_of_rows(monkeypatch):
    monkeypatch.setattr(precision, "CHUNK", 64)  # 40 x 8: slices of 8 rows
    variable = tf.Variable(tf.ones([40, 8], tf.bfloat16))
    sums = precision.BFloat16Sum(variable)
    assert len(sums._slices) == 5
    grad = (np.arange(320, dtype="float32") % 32).reshape(40, 8) / 4.0  # bfloat16 holds each sum
    sums.add(tf.constant(grad), 2.0)
    assert np.array_equal(sums.read().numpy(), 1.0 + 2.0 * grad)
    sums.scale(0.5)
    assert np.array_equal(sums.read().numpy(), (1.0 + 2.0 * grad) / 2.0)
    small = precision.BFloat16Sum(tf.Variable(tf.ones([4, 8], tf.bfloat16)))
    assert small._slices is None


@tensorflow_only
def test_a_scalar_variable_is_summed_whole():
    variable = tf.Variable(tf.constant(1.0, tf.bfloat16))
    sums = precision.BFloat16Sum(variable)
    sums.add(tf.constant(0.75), 2.0)
    sums.scale(0.5)
    assert float(sums.read()) == 1.25


@tensorflow_only
def test_a_large_variable_is_emptied_in_place_a_slice_at_a_time(monkeypatch):
    """No tensor of the whole variable is made: the window's end held zeros of
    it beside the variable, and the assignment copied them into a third buffer."""
    monkeypatch.setattr(precision, "CHUNK", 64)  # 40 x 8: slices of 8 rows
    accumulator = accumulators.BFloat16Accumulator(
        tf.Variable(tf.zeros([40, 8])), tf.VariableSynchronization.AUTO,
        tf.VariableAggregation.NONE)
    accumulator.variable.assign(tf.ones([40, 8], tf.bfloat16))
    accumulator.variable.scatter_update(tf.IndexedSlices(  # what a window may hold
        tf.constant([[np.nan] * 8, [np.inf] * 8], tf.bfloat16), tf.constant([0, 39])))
    graph = tf.function(accumulator.reset).get_concrete_function().graph
    whole = [op.name for op in graph.get_operations()
             if any(output.shape == [40, 8] for output in op.outputs)]
    assert not whole, whole
    accumulator.reset()
    assert np.array_equal(accumulator.read().numpy(), np.zeros([40, 8]))
    small = precision.BFloat16Sum(tf.Variable(tf.ones([4, 8], tf.bfloat16)))
    small.zero()
    assert not small.variable.numpy().any()
