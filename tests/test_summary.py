"""The summaries the callback writes for the Accumulation dashboard."""

import numpy as np
import pytest
import tensorflow as tf

from reference import keras
from reference import make_data
from reference import read_run
from reference import make_model
from reference import not_on_torch

from tfaccum import dashboard_schema
from tfaccum import GradientAccumulationCallback

# Its module-scoped fixtures are built once: its tests share a worker.
pytestmark = pytest.mark.xdist_group("test_summary")


def values(series, name):
    return [float(v) for _, v in series[dashboard_schema.TAG_PREFIX + name]]


def steps(series, name):
    return [s for s, _ in series[dashboard_schema.TAG_PREFIX + name]]


def global_norm(grads):
    return float(tf.sqrt(sum(tf.reduce_sum(tf.square(g)) for g in grads)))


def gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=tf.constant(y), y_pred=model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """3 epochs of 100 samples in micro-batches of 8, windows of 4."""
    log_dir = str(tmp_path_factory.mktemp("logs") / "run")
    x, y = make_data()
    model = make_model(optimizer="sgd")
    callback = GradientAccumulationCallback(accumulation_steps=4, log_dir=log_dir)
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[callback])
    series, metas = read_run(log_dir)
    return dict(log_dir=log_dir, callback=callback, series=series, metas=metas, x=x, y=y)


def last_per_step(series, name):
    """Values by step, the last written winning (as TensorBoard's loaders keep)."""
    return list(dict(zip(steps(series, name), values(series, name))).values())


def test_one_point_per_update_on_the_update_axis(run):
    for name, _ in dashboard_schema.UPDATE_SERIES:
        assert sorted(set(steps(run["series"], name))) == list(range(1, 13)), name
    assert values(run["series"], "window_micro_batches") == [4, 4, 4, 1] * 3
    assert values(run["series"], "window_samples") == [32, 32, 32, 4] * 3
    micro = last_per_step(run["series"], "micro_steps")
    assert micro == [4, 8, 12, 13, 17, 21, 25, 26, 30, 34, 38, 39]
    skipped = last_per_step(run["series"], "skipped_updates")
    assert skipped == [m - u for m, u in zip(micro, range(1, 13))]
    assert skipped[-1] == run["callback"].micro_steps - run["callback"].optimizer_steps


@pytest.mark.backend("tensorflow", reason="its oracle is a tf.GradientTape; on JAX: "
                     "test_jax.py::test_the_dashboard_reads_the_same_series_and_events")
def test_first_update_norms_match_the_large_batch_gradient(run):
    x, y = run["x"], run["y"]
    model = make_model(optimizer="sgd")  # the same initial weights
    large = gradients(model, x[:32], y[:32])
    applied = values(run["series"], "applied_gradient_norm")
    assert applied[0] == pytest.approx(global_norm(large), rel=1e-5)
    micro = [global_norm(gradients(model, x[i:i + 8], y[i:i + 8])) for i in range(0, 32, 8)]
    assert values(run["series"], "micro_norm_mean")[0] == pytest.approx(np.mean(micro), rel=1e-5)
    assert values(run["series"], "micro_norm_max")[0] == pytest.approx(max(micro), rel=1e-5)
    # Per-variable norms: one series per trainable variable, adding up.
    per_variable = {tag: s for tag, s in run["series"].items()
                    if tag.startswith(dashboard_schema.ACCUMULATOR_PREFIX)}
    assert len(per_variable) == len(model.trainable_variables) == 4
    first = [float(s[0][1]) for s in per_variable.values()]
    expected = [float(tf.norm(grad)) for grad in large]
    np.testing.assert_allclose(sorted(first), sorted(expected), rtol=1e-5)
    # Named by layer and variable, without the (auto-numbered) model name.
    assert sorted(tag.split("/", 2)[2].split("/", 1)[1] for tag in per_variable) == [
        "bias", "bias", "kernel", "kernel"]
    assert all(not tag.split("/")[2].startswith("sequential") for tag in per_variable)
    assert np.sqrt(np.sum(np.square(first))) == pytest.approx(applied[0], rel=1e-5)


def test_leftover_events(run):
    series = run["series"]
    assert steps(series, "leftover/policy") == [4, 8, 12]  # at the flushed update
    assert values(series, "leftover/policy") == [0, 0, 0]  # flushed
    assert values(series, "leftover/micro_batches") == [1, 1, 1]
    assert values(series, "leftover/samples") == [4, 4, 4]


def test_metadata_marks_every_series(run):
    for tag, meta in run["metas"].items():
        assert meta.plugin_data.plugin_name == dashboard_schema.PLUGIN_NAME
        assert meta.data_class == dashboard_schema.summary_pb2.DATA_CLASS_SCALAR
        content = dashboard_schema.parse_plugin_metadata(meta.plugin_data.content)
        assert content.version == dashboard_schema.PROTO_VERSION
        assert content.kind != dashboard_schema.Kind.KIND_UNSPECIFIED
        if tag.startswith(dashboard_schema.ACCUMULATOR_PREFIX):
            assert content.kind == dashboard_schema.Kind.ACCUMULATOR_NORM
            assert tag == dashboard_schema.ACCUMULATOR_PREFIX + content.variable
    for _, value in run["series"][dashboard_schema.TAG_PREFIX + "applied_gradient_norm"]:
        assert value.dtype == np.float32 and value.shape == ()


def test_newer_content_version_is_skipped():
    newer = dashboard_schema.PluginData(version=dashboard_schema.PROTO_VERSION + 1, kind=1)
    assert dashboard_schema.parse_plugin_metadata(newer.SerializeToString()) is None


def test_carry_and_drop_events(tmp_path):
    x, y = make_data()
    for leftover, code in (("carry", 1), ("drop", 2)):
        log_dir = str(tmp_path / leftover)
        model = make_model()
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[GradientAccumulationCallback(
                      accumulation_steps=4, leftover=leftover, log_dir=log_dir)])
        series, _ = read_run(log_dir)
        policies = values(series, "leftover/policy")
        if leftover == "carry":
            # Epoch 1 carries 1 micro-batch into epoch 2, which ends with 2
            # left over; fit's end flushes them as the 7th update.
            assert policies == [1, 1, 0]
            assert values(series, "leftover/micro_batches") == [1, 2, 2]
            assert steps(series, "leftover/policy") == [3, 6, 7]
        else:
            assert policies == [code, code]
            assert steps(series, "leftover/policy") == [3, 6]


@pytest.mark.once
@not_on_torch("jit_compile")
def test_jit_compile_writes_the_same(tmp_path):
    x, y = make_data()
    runs = {}
    for jit in (False, True):
        log_dir = str(tmp_path / f"jit{jit}")
        model = make_model(optimizer="adam", jit_compile=jit)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=4, log_dir=log_dir)])
        runs[jit] = values(read_run(log_dir)[0], "applied_gradient_norm")
    np.testing.assert_allclose(runs[True], runs[False], rtol=1e-5)


def test_buffer_is_written_before_it_fills(tmp_path, monkeypatch):
    """50 updates in one epoch through a device buffer of 16 rows."""
    import importlib

    from reference import BACKEND as name

    backend = importlib.import_module(f"tfaccum.backend.{name}").BACKEND

    class SixteenRows(backend.summaries_class):
        def __init__(self, log_dir, **kwargs):
            super().__init__(log_dir, capacity=16, **kwargs)

    monkeypatch.setattr(backend, "summaries_class", SixteenRows)
    x, y = make_data(n=400)
    log_dir = str(tmp_path / "run")
    callback = GradientAccumulationCallback(accumulation_steps=1, log_dir=log_dir)
    make_model().fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                     callbacks=[callback])
    assert callback.summaries.capacity == 16
    assert steps(read_run(log_dir)[0], "applied_gradient_norm") == list(range(1, 51))


def test_writer_is_created_lazily(tmp_path):
    """No writer until the first write (the first epoch's end); the directory is
    made, and probed by writing, when `fit` starts, before any batch trains."""
    from reference import keras

    x, y = make_data(n=32)
    log_dir = tmp_path / "later"
    callback = GradientAccumulationCallback(accumulation_steps=2, log_dir=log_dir)
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((log_dir.exists(), callback.summaries._writer is not None))

    assert not log_dir.exists()
    make_model().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback, Probe()])
    assert seen == [(True, False)] * 4  # two updates buffered, nothing written yet
    assert callback.summaries._writer is not None and any(log_dir.iterdir())


def test_scalars_option_writes_a_plain_scalar(tmp_path):
    x, y = make_data()
    log_dir = str(tmp_path / "run")
    model = make_model()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4, log_dir=log_dir, scalars=True)])
    series, metas = read_run(log_dir)
    assert metas["accumulation/gradient_norm"].plugin_data.plugin_name == "scalars"
    assert [float(v) for _, v in series["accumulation/gradient_norm"]] == pytest.approx(
        values(series, "applied_gradient_norm"))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(log_dir=3), TypeError, r"`log_dir` must be a path \(str or os.PathLike\) or None. Received: log_dir=3"),
        (dict(log_dir="x", scalars="yes"), TypeError, r"`scalars` must be True or False. Received: scalars='yes'"),
        (dict(scalars=True), ValueError, r"`scalars=True` writes to `log_dir`"),
    ],
)
def test_bad_summary_options(kwargs, error, message):
    with pytest.raises(error, match=message):
        GradientAccumulationCallback(accumulation_steps=2, **kwargs)


KILLED_RUN = r'''
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from reference import keras, make_data, make_model
from tfaccum import GradientAccumulationCallback

x, y = make_data(n=8 * 200)
log = open({timeline!r}, "w")

class SlowAndKilled(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.02)  # a slow model
        log.write(f"{{time.monotonic()}} {{int(self.model.optimizer.iterations)}}\n")
        log.flush()
        if batch == 120:
            os.kill(os.getpid(), signal.SIGKILL)

callback = GradientAccumulationCallback(accumulation_steps=1, log_dir={log_dir!r},
                                        write_interval={interval})
make_model().fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                 callbacks=[callback, SlowAndKilled()])
'''


def test_a_killed_run_keeps_what_is_older_than_the_write_interval(tmp_path):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    interval = 0.5
    log_dir, timeline = tmp_path / "run", tmp_path / "timeline"
    script = KILLED_RUN.format(tests=str(Path(__file__).parent), timeline=str(timeline),
                               log_dir=str(log_dir), interval=interval)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    points = [line.split() for line in timeline.read_text().splitlines()]
    killed_at = float(points[-1][0])
    # Every update made more than the interval (plus a batch) before the kill.
    old = [int(i) for t, i in points if float(t) < killed_at - interval - 0.1]
    assert old and old[-1] > 20
    written = steps(read_run(str(log_dir))[0], "applied_gradient_norm")
    assert written[:old[-1]] == list(range(1, old[-1] + 1))


@pytest.mark.parametrize("loss_reduction", ["sum_over_batch_size", "sum"])
def test_the_applied_norm_is_that_of_the_gradient_the_optimizer_applied(tmp_path,
                                                                         loss_reduction):
    """On every backend: plain SGD moves the weights by lr times what it applied,
    whatever the loss's reduction (a summed loss's applied gradient is a sum)."""
    x, y = make_data(n=16)
    model = make_model(loss=keras.losses.MeanSquaredError(reduction=loss_reduction))
    before = [np.array(w) for w in model.trainable_weights]
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[
        GradientAccumulationCallback(accumulation_steps=4, log_dir=str(tmp_path))])
    moved = [(b - np.array(w)) / 0.05 for b, w in zip(before, model.trainable_weights)]
    applied = np.sqrt(sum(float(np.sum(m.astype(np.float64) ** 2)) for m in moved))
    series, _ = read_run(str(tmp_path))
    assert values(series, "applied_gradient_norm") == [pytest.approx(applied, rel=1e-3)]
