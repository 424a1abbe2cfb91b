"""What only the JAX backend has: its refusals by name, `DataParallel`, its estimator's
and dashboard's exact oracles in jax.numpy.

Every behaviour both backends share is tested once, in the suite's other files,
which the JAX pass runs too (`KERAS_BACKEND=jax`, `make test`); conftest.py
leaves this file out of the TensorFlow passes. Every comparison is update for
update, through the shared oracle (`reference.compare`).
"""

import sys

import numpy as np
import pytest

from reference import keras
from reference import make_data
from reference import make_model
from reference import max_diff
from reference import refused_then_plain
from reference import train_large_batches
from reference import windows

import tfaccum

TOL = 1e-5


def model_builder(optimizer="adam", **compile_kwargs):
    return lambda: make_model(optimizer=optimizer, **compile_kwargs)


def sequences(n=40):
    """Sequences padded to different lengths (1 to 6 tokens): micro-batches count
    different numbers of tokens."""
    rng = np.random.default_rng(5)
    x = rng.integers(1, 10, size=(n, 6)).astype("int32")
    lengths = rng.integers(1, 7, size=n)
    x[np.arange(6)[None, :] >= lengths[:, None]] = 0
    return x, rng.integers(0, 3, size=(n, 6)).astype("int32")


def two_heads_data():
    """test_items.py's two heads (per token, masked; per sequence), and their targets."""
    from test_items import sequences as padded

    tokens, labels, _, _ = padded()
    return tokens, {"per_token": labels,
                    "per_sequence": labels.mean(axis=1, keepdims=True).astype("float32")}


@pytest.mark.parametrize("case", ["skip_nonfinite", "steps_per_execution", "bfloat16",
                                  "mixed_float16"])
def test_outputs_that_count_differently_meet_the_other_options(case, monkeypatch):
    # Each output's gradient apart (test_items.py: one device, the options
    # off); here with the options they meet. 50 sequences in micro-batches of
    # 4, windows of 4.
    from reference import compare
    from test_items import two_heads

    from tfaccum.backend.jax.window_program import WindowProgram

    compiled = []
    step = WindowProgram.step
    monkeypatch.setattr(WindowProgram, "step", lambda self, state, batch: (
        compiled.append(len(batch)), step(self, state, batch))[1])
    tokens, y = two_heads_data()
    build, kwargs, left_out = (lambda: two_heads("adam")), {}, ()
    if case == "skip_nonfinite":  # the sixth micro-batch of each epoch left out whole
        y["per_sequence"][21] = np.nan
        kwargs, left_out = {"skip_nonfinite": True}, [(0, 5), (1, 5)]
    elif case == "bfloat16":
        kwargs = {"accumulator_dtype": "bfloat16"}
    elif case == "mixed_float16":  # a LossScaleOptimizer: each output's share scaled too
        def build():
            # A scale no micro-batch overflows (at 2**15 the first does where
            # the large batch does not: left out, as it should be, it is no
            # update for update comparison).
            keras.config.set_dtype_policy("mixed_float16")
            try:
                return two_heads(keras.optimizers.LossScaleOptimizer(
                    keras.optimizers.Adam(0.01), initial_scale=2.0**8))
            finally:
                keras.config.set_dtype_policy("float32")
    elif case == "steps_per_execution":  # windows compiled whole after the first
        # (One window an execution: the recorder sees the weights after each.)
        kwargs = {"noise_scale": False}  # the noise scale takes micro-steps one by one
        build = lambda: two_heads("adam", steps_per_execution=4)  # noqa: E731
    result = compare(build, tokens, y, micro=4, steps=4, epochs=2, left_out=left_out,
                     callback_kwargs=kwargs)
    bound = {"bfloat16": 2e-3, "mixed_float16": 2e-3}.get(case, TOL)
    assert result.diff < bound, result.diff
    # Three full windows an epoch, less the first update (traced one micro-step at a time).
    assert len(compiled) == (5 if case == "steps_per_execution" else 0)
    assert result.moved(lambda: two_heads("adam")) > 1e-2


def test_outputs_that_count_differently_under_data_parallel(tmp_path):
    # Each device accumulates its share of each output; each output's count
    # and loss over both devices divide them when the window ends. Keras'
    # logs show each micro-batch's loss as on one device.
    from reference import read_run
    from test_items import two_heads
    from test_summary import values

    tokens, y = two_heads_data()
    log_dir = str(tmp_path / "run")
    result = data_parallel(lambda: two_heads("sgd_momentum"), tokens, y, micro=4, steps=4,
                           epochs=2, log_dir=log_dir)
    assert result.diff < TOL
    one_device = two_heads("sgd_momentum")
    one_device.fit(tokens, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[
        tfaccum.GradientAccumulationCallback(accumulation_steps=4)])
    np.testing.assert_allclose(result.model.history.history["loss"],
                               one_device.history.history["loss"], rtol=1e-5)
    reference = two_heads("sgd_momentum")
    large = [reference.train_on_batch(tokens[s:s + 16], {k: v[s:s + 16] for k, v in y.items()},
                                      return_dict=True)["loss"]
             for _ in range(2) for s in range(0, 50, 16)]
    np.testing.assert_allclose(values(read_run(log_dir)[0], "window_loss"), large, rtol=1e-5)


def linear_gradient(w, b, x, y):
    """The gradient of the mean squared error of `x @ w + b` (Dense(1)), flattened."""
    residual = x @ w + b - y
    return np.concatenate([(2.0 / len(x) * x.T @ residual).ravel(),
                           [2.0 / len(x) * residual.sum()]])


def test_the_noise_scale_is_estimated_from_each_window_as_on_tensorflow():
    from tfaccum.noise_scale import smoothed
    from tfaccum.noise_scale import window_estimates

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + rng.normal(size=(256, 1))).astype("float32")
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")  # weights stay fixed
    w, b = (np.asarray(v, "float64") for v in model.get_weights())
    callback = tfaccum.GradientAccumulationCallback(accumulation_steps=4)
    assert callback.noise_scale is None
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[callback])
    gradient_square = trace = 0.0
    for start in range(0, 256, 32):
        window = slice(start, start + 32)
        squares = sum(8 * np.sum(linear_gradient(w, b, x[i:i + 8], y[i:i + 8]) ** 2)
                      for i in range(start, start + 32, 8))
        big_square = np.sum(linear_gradient(w, b, x[window], y[window]) ** 2)
        _, _, square, window_trace = window_estimates(big_square, 32.0, squares, 32.0, 4.0, np)
        first = start == 0
        gradient_square = smoothed(gradient_square, square, first, np)
        trace = smoothed(trace, window_trace, first, np)
    assert callback.noise_scale == pytest.approx(trace / gradient_square, rel=1e-4)
    assert callback.suggested_accumulation_steps >= 1


def test_the_dashboard_reads_the_same_series_and_events(tmp_path):
    import jax
    import jax.numpy as jnp

    from test_plugin import client_for
    from test_plugin import get_json

    from tfaccum import dashboard_schema

    x, y = make_data()  # 100 samples: 3 windows of 4 micro-batches and 1 left, per epoch
    callbacks = {}
    for run, leftover in (("flushing", "flush"), ("dropping", "drop")):
        callbacks[run] = tfaccum.GradientAccumulationCallback(
            accumulation_steps=4, leftover=leftover, log_dir=str(tmp_path / run))
        make_model(optimizer="adam").fit(x, y, batch_size=8, epochs=3, shuffle=False,
                                         verbose=0, callbacks=[callbacks[run]])
    client = client_for(tmp_path)
    runs = get_json(client, "/runs")["runs"]
    assert runs == [{"run": "dropping", "updates": 9, "variables": 4, "problems": []},
                    {"run": "flushing", "updates": 12, "variables": 4, "problems": []}]
    body = get_json(client, "/series?run=flushing")
    assert body["steps"] == list(range(1, 13))
    series = body["series"]
    assert set(series) == {name for name, _ in dashboard_schema.UPDATE_SERIES}
    assert series["window_micro_batches"] == [4, 4, 4, 1] * 3
    assert series["window_samples"] == [32, 32, 32, 4] * 3
    assert series["micro_steps"] == [4, 8, 12, 13, 17, 21, 25, 26, 30, 34, 38, 39]
    assert series["noise_scale"][0] > 0
    # The first update applied the gradient of the first 32 samples' mean loss.
    model = make_model(optimizer="adam")
    trainable = [v.value for v in model.trainable_variables]
    others = [v.value for v in model.non_trainable_variables]

    def loss(values):
        y_pred, _ = model.stateless_call(values, others, x[:32])
        return jnp.mean(jnp.square(y_pred - y[:32]))

    grads = jax.grad(loss)(trainable)
    # The window's loss is the large batch's, before the update.
    assert series["window_loss"][0] == pytest.approx(float(loss(trainable)), rel=1e-5)
    assert series["applied_gradient_norm"][0] == pytest.approx(
        float(jnp.sqrt(sum(jnp.sum(g ** 2) for g in grads))), rel=1e-5)
    accumulators = body["accumulators"]
    for column in range(12):
        combined = np.sqrt(sum(row[column] ** 2 for row in accumulators["values"]))
        assert combined == pytest.approx(series["applied_gradient_norm"][column], rel=1e-5)
    flushing = get_json(client, "/events?run=flushing")
    assert flushing["events"][0] == {"step": 4, "policy": "flush", "micro_batches": 1,
                                     "samples": 4}
    for run, callback in callbacks.items():
        counters = get_json(client, f"/events?run={run}")["counters"]
        assert counters["optimizer_steps"] == callback.optimizer_steps
        assert counters["micro_steps"] == callback.micro_steps == 39
        assert counters["flushes"] == callback.flushes
        assert counters["dropped_micro_steps"] == callback.dropped_micro_steps
    assert callbacks["dropping"].dropped_micro_steps == 3


def test_tensorflows_batch_normalization_is_refused_by_name_on_jax():
    # TensorFlow's layer (made where TensorFlow's tfaccum is imported) is refused,
    # not trained as plain BatchNormalization; JAX's own serves (test_layers.py).
    from tfaccum.backend.tensorflow.batch_norm.layers import AccumBatchNormalization

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4),
                                  AccumBatchNormalization(), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    x, y = make_data(n=32)
    refused_then_plain(build, x, y, "AccumBatchNormalization")


def test_a_train_step_of_its_own_is_refused_by_name():
    # Keras' JAX trainer passes the state through `train_step(state, data)`;
    # the accumulating step computes the gradients itself and would skip it.
    class OwnStep(keras.Sequential):
        def train_step(self, state, data):
            logs, state = super().train_step(state, data)
            return dict(logs, mine=1.0), state

    def build():
        keras.utils.set_random_seed(1)
        model = OwnStep([keras.Input((5,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    x, y = make_data(n=32)
    refused_then_plain(build, x, y, r"OwnStep.train_step")


def regularized_sequence_model():
    keras.utils.set_random_seed(4)
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(10, 4, mask_zero=True),
        keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.5)),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


# -- several devices: keras.distribution.DataParallel --------------------------------


def data_parallel(build, x, y, *, micro, steps, epochs=1, sample_weight=None, left_out=(),
                  **callback_kwargs):
    """tfaccum under `DataParallel` on the two CPU devices (conftest.py), against
    plain Keras on one device at the global window."""
    from reference import Comparison
    from reference import fit_accumulated

    callback = tfaccum.GradientAccumulationCallback(accumulation_steps=steps, **callback_kwargs)
    with keras.distribution.DataParallel().scope():
        model = build()
        ours, callback = fit_accumulated(model, x, y, micro=micro, steps=steps, epochs=epochs,
                                         callback=callback, sample_weight=sample_weight)
    updates = windows(len(x), micro, steps, epochs, callback_kwargs.get("leftover", "flush"),
                      left_out=left_out)
    reference = build()
    theirs = train_large_batches(reference, x, y, updates, sample_weight=sample_weight)
    return Comparison(model=model, reference=reference, callback=callback, ours=ours,
                      theirs=theirs, updates=updates)


@pytest.mark.parametrize("reduction", ["auto", "mean", "sum"])
def test_data_parallel_equals_one_device_at_the_global_window(reduction):
    # 88 samples in micro-batches of 8 (4 on each device), windows of 3: each
    # epoch ends with a window of two micro-batches, flushed. Sample weights
    # differ between the devices' shares.
    loss = keras.losses.MeanSquaredError(reduction="sum") if reduction == "sum" else "mse"

    def build():
        return make_model(optimizer="adam", loss=loss, metrics=["mae"])

    x, y = make_data(n=88)
    weights = np.linspace(0.0, 2.0, 88).astype("float32")
    result = data_parallel(build, x, y, micro=8, steps=3, epochs=2, sample_weight=weights,
                           reduction=reduction, noise_scale=False)
    assert len(result.ours) == 2 * 4
    assert result.diff < TOL
    assert result.moved(build) > 1e-2
    assert result.callback.counters.samples == 176
    assert result.callback.counters.optimizer_steps == 8


def test_data_parallel_counts_each_devices_tokens():
    # The devices' shares hold different numbers of tokens: each weighs what
    # it counted. The first device's shares of the first window count none
    # (rows 0-1, 4-5, 8-9), those of the second window's first micro-batch
    # neither (rows 12-13): what they added (the regularizer's gradient) is
    # not the large batch's.
    x, y = sequences(48)
    x[[0, 1, 4, 5, 8, 9, 12, 13]] = 0
    result = data_parallel(regularized_sequence_model, x, y, micro=4, steps=3, epochs=2)
    assert result.diff < TOL
    assert result.moved(regularized_sequence_model) > 1e-2
    assert result.callback.counters.items == 2 * int(np.sum(x != 0))


def compiled_text(function, *args):
    return function.lower(*args).compile().as_text()


def all_reduced_elements(hlo):
    """Elements each all-reduce of a compiled module reduces, summed."""
    import re

    total = 0
    for line in hlo.splitlines():
        if " all-reduce(" not in line and " all-reduce-start(" not in line:
            continue
        result = line.split("=", 1)[1].split("all-reduce")[0]  # the result's shapes
        shapes = re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]", result)
        for dims in shapes:
            total += int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def test_data_parallel_reduces_gradients_once_per_update():
    # Counted in the compiled (partitioned) programs: a micro-step all-reduces
    # a few scalars (the loss, the counts), a window's end the gradient once.
    # A frozen layer's weights are not reduced; a dropout's seed is each device's.
    import jax

    x, y = make_data(n=32)
    with keras.distribution.DataParallel().scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(64, trainable=False),
                                  keras.layers.Dropout(0.1), keras.layers.Dense(7),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        hook = tfaccum.install_accumulation_hook(model, accumulation_steps=4)
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        steps = hook._compiled
        state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                     optimizer_variables=True, metrics_variables=True)
        data = jax.device_put((x[:8], y[:8]), hook.devices.batch_sharding())
        micro = compiled_text(steps.accumulate, state, hook._accumulators, hook._observed,
                              hook.counts.on_device, data, hook._window_vector(),
                              np.int32(8))
        end = compiled_text(steps.normalize, hook._accumulators, hook._observed,
                            hook.counts.on_device, hook._window_vector())
        keras_step = compiled_text(jax.jit(model.train_step), state, data)
        tfaccum.remove_accumulation_hook(model)
    assert all_reduced_elements(micro) <= 8
    assert all_reduced_elements(end) >= parameters
    assert all_reduced_elements(keras_step) >= parameters  # plain Keras: every step


def with_batch_norm():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def model_parallel():
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["no_variable_here"] = (None, "model")  # the model's widths are odd
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


@pytest.mark.parametrize("distribution, build, match", [
    # Each device's statistics are not the micro-batch's (Keras' own
    # DataParallel normalises over the whole micro-batch).
    (keras.distribution.DataParallel, with_batch_norm, "BatchNormalization"),
    (model_parallel, model_builder(), "ModelParallel"),
])
def test_what_several_devices_do_not_serve_is_refused_by_name(distribution, build, match):
    x, y = make_data(n=32)
    with distribution().scope():
        refused_then_plain(build, x, y, match)


def test_data_parallel_meets_ema_clipping_steps_per_execution_and_the_dashboard(tmp_path):
    from reference import read_run

    def build():
        return make_model(optimizer=lambda: keras.optimizers.AdamW(
            0.01, use_ema=True, ema_overwrite_frequency=3, global_clipnorm=0.1),
            steps_per_execution=2)

    x, y = make_data(n=88)
    result = data_parallel(build, x, y, micro=8, steps=3, epochs=2,
                           log_dir=str(tmp_path), noise_scale=True)
    assert result.diff < TOL
    assert result.moved(build) > 1e-2
    callback = result.callback
    # Each device's share is a micro-batch to the noise scale's estimate.
    assert callback.noise_scale is not None and callback.noise_scale > 0
    series, _ = read_run(str(tmp_path))
    steps = [step for step, _ in series["accumulation/window_micro_batches"]]
    assert steps == list(range(1, 9))
    assert [int(v) for _, v in series["accumulation/window_samples"]] == [24, 24, 24, 16] * 2
    assert int(series["accumulation/micro_steps"][-1][1]) == callback.micro_steps == 22


def test_data_parallel_draws_each_devices_own_dropout_masks():
    # The devices' shares hold the same samples: with one seed they would
    # drop the same units, and the two halves of a micro-batch would give the
    # same gradient.
    import jax

    keras.utils.set_random_seed(2)
    with keras.distribution.DataParallel().scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(64),
                                  keras.layers.Dropout(0.5), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        hook = tfaccum.install_accumulation_hook(model, accumulation_steps=2)
        x, y = make_data(n=4)
        x, y = np.concatenate([x, x]), np.concatenate([y, y])  # rows 0-3 as 4-7
        model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        halves = [np.asarray(shard.data) for shard in hook._accumulators[0].addressable_shards]
        hook.drop()
        tfaccum.remove_accumulation_hook(model)
    assert len(jax.devices()) == 2 and len(halves) == 2
    assert np.max(np.abs(halves[0] - halves[1])) > 1e-3


def test_a_keras_hub_gpt2_under_data_parallel():
    # Compiled with jit_compile=False: under DataParallel the steps compile
    # anyway (one device's share run op by op over the mesh takes minutes).
    from test_keras_hub import gpt2_causal_lm
    from test_keras_hub import sentences

    texts = sentences()
    reference = gpt2_causal_lm()
    reference.fit(texts, batch_size=16, epochs=2, shuffle=False, verbose=0)
    with keras.distribution.DataParallel().scope():
        model = gpt2_causal_lm()
        callback = tfaccum.GradientAccumulationCallback(accumulation_steps=4)
        model.fit(texts, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    assert max_diff(model, reference) < TOL
    assert max_diff(model, gpt2_causal_lm()) > 1e-3
    assert (callback.optimizer_steps, callback.micro_steps, callback.flushes) == (6, 20, 2)


def test_nan_in_one_micro_batch_spoils_its_window_as_it_spoils_the_large_batch():
    # Without skip_nonfinite, under DataParallel too the NaN reaches the update
    # where the large batch's does, and nowhere else (one device:
    # test_degenerate.py).
    x, y = make_data(n=48)
    x[29, 2] = np.nan  # the second window's second micro-batch
    result = data_parallel(model_builder("sgd"), x, y, micro=8, steps=3)
    assert len(result.ours) == len(result.theirs) == 2
    for ours, theirs in zip(result.ours, result.theirs):
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, equal_nan=True)
    assert np.isfinite(np.concatenate([w.ravel() for w in result.ours[0]])).all()
    assert not np.isfinite(np.concatenate([w.ravel() for w in result.ours[1]])).all()


@pytest.mark.parametrize("reduction", ["auto", "samples", "mean"])
def test_data_parallel_leaves_a_non_finite_micro_batch_out_whole(reduction):
    # Samples 28-31, the second device's share of the fourth micro-batch, hold
    # a NaN: both devices leave that micro-batch out (TensorFlow's replicas
    # leave out their own shares: test_distribution.py), and its window
    # divides by what was kept.
    x, y = make_data(n=48)
    x[29, 2] = np.nan
    result = data_parallel(model_builder("adam"), x, y, micro=8, steps=3, epochs=2,
                           left_out=[(0, 3), (1, 3)], reduction=reduction, skip_nonfinite=True)
    assert len(result.ours) == len(result.theirs) == 4
    assert result.diff < TOL
    assert result.moved(model_builder("adam")) > 1e-2
    counters = result.callback.counters
    assert (counters.nonfinite_skips, counters.samples, counters.optimizer_steps) == (2, 80, 4)


def test_a_window_left_out_whole_makes_no_update_and_no_dashboard_point(tmp_path):
    from test_plugin import client_for
    from test_plugin import get_json

    x, y = make_data(n=72)  # micro-batches of 8, windows of 3: 3 windows an epoch
    x[24:48, 1] = np.inf  # the second window's three micro-batches
    callback = tfaccum.GradientAccumulationCallback(accumulation_steps=3, skip_nonfinite=True,
                                                    log_dir=str(tmp_path / "run"))
    model = model_builder("adam")()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    assert (callback.optimizer_steps, callback.nonfinite_skips, callback.samples) == (4, 6, 96)
    assert int(model.optimizer.iterations.numpy()) == 4
    reference = model_builder("adam")()
    keep = np.r_[0:24, 48:72]
    reference.fit(x[keep], y[keep], batch_size=24, epochs=2, shuffle=False, verbose=0)
    assert max_diff(model, reference) < TOL
    body = get_json(client_for(tmp_path), "/series?run=run")
    assert body["steps"] == [1, 2, 3, 4]
    assert body["series"]["micro_steps"] == [3, 9, 12, 18]
    assert body["series"]["nonfinite_skips"] == [0, 3, 3, 6]
    assert body["series"]["window_samples"] == [24] * 4


# -- several processes: DataParallel over two local JAX processes ----------------------


def two_processes(out, case):
    """Runs two_jax_processes.py; returns each process's weights and counters."""
    import json
    import pathlib
    import subprocess

    here = pathlib.Path(__file__).parent
    out.mkdir()
    result = subprocess.run([sys.executable, str(here / "two_jax_processes.py"), str(out), case],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    weights = []
    for process in (0, 1):
        with np.load(out / f"weights{process}.npz") as saved:
            weights.append([saved[f"arr_{i}"] for i in range(len(saved.files))])
    counters = [json.loads((out / f"counters{process}.json").read_text()) for process in (0, 1)]
    return weights, counters


def global_windows(left_out=()):
    """The samples of each update at the global window: micro-step k of an epoch
    holds rows 4k..4k+3 of each process's shard (samples 0-31 and 32-63)."""
    from two_jax_processes import EPOCHS, LOCAL_BATCH, SAMPLES, STEPS

    half, micro_steps = SAMPLES // 2, SAMPLES // 2 // LOCAL_BATCH
    updates = []
    for _ in range(EPOCHS):
        for start in range(0, micro_steps, STEPS):  # a partial window is flushed
            window = [shard * half + LOCAL_BATCH * k + i
                      for k in range(start, min(start + STEPS, micro_steps))
                      if k not in left_out for shard in (0, 1) for i in range(LOCAL_BATCH)]
            if window:
                updates.append(sorted(window))
    return updates


@pytest.mark.parametrize("case", ["tfaccum", "nonfinite", "bfloat16", "outputs"])
def test_two_processes_train_as_one_at_the_global_window(tmp_path, case):
    # Each process feeds its own shard; a micro-step's global batch is both
    # processes' micro-batches. With `nonfinite` one sample of the second
    # process's third micro-batch is infinite: the global micro-batch is
    # left out whole, on both. With `bfloat16` the accumulators round
    # stochastically, alike on both processes: close to the large batch, not
    # equal. With `outputs` each process's masked head counts its own tokens,
    # totalled over both at the window's end. Process 0 alone writes the
    # summaries.
    from two_jax_processes import build_model
    from two_jax_processes import data

    weights, counters = two_processes(tmp_path / case, case)
    assert max_diff(weights[0], weights[1]) == 0  # the same update on every process
    assert counters[0] == counters[1]
    x, y = data(case)
    updates = global_windows(left_out=(2,) if case == "nonfinite" else ())
    reference = build_model(keras, case)
    train_large_batches(reference, x, y, updates)
    assert max_diff(weights[0], reference) < (1e-2 if case == "bfloat16" else TOL)
    assert max_diff(weights[0], build_model(keras, case)) > 1e-2
    assert counters[0]["optimizer_steps"] == counters[0]["iterations"] == len(updates) == 6
    assert counters[0]["samples"] == sum(len(u) for u in updates)
    assert counters[0]["nonfinite_skips"] == (2 if case == "nonfinite" else 0)
    assert len(list((tmp_path / case / "logs").rglob("*.tfevents.*"))) == 1


# -- a window compiled as one program (steps_per_execution) -----------------------------


@pytest.mark.parametrize("options", [
    {}, {"skip_nonfinite": True}, {"accumulator_dtype": "bfloat16"}, {"leftover": "drop"},
    {"leftover": "carry"}, {"reduction": "mean"}, {"noise_scale": None}, {"log_dir": True}],
    ids=["no_noise", "skip_nonfinite", "bfloat16", "drop", "carry", "mean", "noise_scale",
         "log_dir"])
def test_a_window_runs_as_one_program_as_its_micro_steps_do(options, tmp_path, monkeypatch):
    # steps_per_execution a multiple of accumulation_steps: each full window
    # (after the first update) runs as one compiled program where no observer
    # takes each micro-batch's gradient norm (the noise scale, the dashboard:
    # their micro-steps run one by one); the result is the micro-step path's,
    # counters and dashboard included.
    options = dict({"noise_scale": False}, **options)
    observed = options["noise_scale"] is not False or "log_dir" in options
    from reference import read_run

    from tfaccum.backend.jax.window_program import WindowProgram

    windows_compiled = []
    step = WindowProgram.step
    monkeypatch.setattr(WindowProgram, "step", lambda self, state, batch: (
        windows_compiled.append(len(batch)), step(self, state, batch))[1])
    x, y = make_data(n=100)  # 13 micro-batches an epoch: 3 windows of 4 and 1 left
    x[45, 0] = np.inf if options.get("skip_nonfinite") else x[45, 0]
    runs = {}
    for spe in (1, 8):
        kwargs = dict(options)
        if kwargs.pop("log_dir", None):
            kwargs["log_dir"] = str(tmp_path / f"spe{spe}")
        keras.utils.set_random_seed(3)
        model = make_model(optimizer="adam", steps_per_execution=spe)
        callback = tfaccum.GradientAccumulationCallback(accumulation_steps=4, **kwargs)
        model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[callback])
        runs[spe] = (model, callback)
        if spe == 1:
            assert not windows_compiled
    (one, one_callback), (window, window_callback) = runs[1], runs[8]
    assert (not windows_compiled) if observed else set(windows_compiled) == {4}
    assert max_diff(window, one) < 1e-6
    assert window_callback.counters == one_callback.counters
    assert int(window.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy())
    if "log_dir" in options:
        # (The models' layers are named apart: the series are compared by order.)
        ours, theirs = ({tag.split("accumulator_norm/")[0] + str(i): points
                         for i, (tag, points) in enumerate(sorted(read_run(str(run))[0].items()))}
                        for run in (tmp_path / "spe8", tmp_path / "spe1"))
        assert ours.keys() == theirs.keys() and len(ours) > 10
        for tag in ours:
            np.testing.assert_allclose([v for _, v in ours[tag]], [v for _, v in theirs[tag]],
                                       rtol=1e-5, err_msg=tag)
            assert [s for s, _ in ours[tag]] == [s for s, _ in theirs[tag]], tag
