"""The Accumulation plugin's routes, over event files the real callback wrote."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_provider
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.plugins import base_plugin
from werkzeug import test as werkzeug_test

from reference import make_data
from reference import make_model

from tb_plugin import cache
from tfaccum import dashboard_schema
from tb_plugin.downsample import downsample_min_max
from tb_plugin.loader import AccumulationPluginLoader
from tb_plugin.plugin import AccumulationPlugin
from tfaccum import GradientAccumulationCallback

# Its module-scoped fixtures are built once: its tests share a worker.
pytestmark = pytest.mark.xdist_group("test_plugin")

PREFIX = "/data/plugin/accumulation"


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    """Two runs: 3 epochs of 100 samples, micro-batches of 8, windows of 4."""
    root = tmp_path_factory.mktemp("logs")
    x, y = make_data()
    callbacks = {}
    for run, leftover in (("flushing", "flush"), ("dropping", "drop")):
        callback = GradientAccumulationCallback(
            accumulation_steps=4, leftover=leftover, log_dir=str(root / run))
        make_model(optimizer="adam").fit(x, y, batch_size=8, epochs=3, shuffle=False,
                                         verbose=0, callbacks=[callback])
        callbacks[run] = callback
    # A run whose gradients become non-finite: one sample holds an infinity.
    x_bad = x.copy()
    x_bad[40, 0] = np.inf
    make_model().fit(x_bad, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                     callbacks=[GradientAccumulationCallback(
                         accumulation_steps=4, log_dir=str(root / "nonfinite"))])
    return root, callbacks


def client_for(root, hints=None):
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        tensor_size_guidance={dashboard_schema.PLUGIN_NAME: 0})
    multiplexer.AddRunsFromDirectory(str(root))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(root))
    context = base_plugin.TBContext(logdir=str(root), data_provider=provider,
                                    sampling_hints=hints or {})
    plugin = AccumulationPlugin(context)
    app = application.TensorBoardWSGI([plugin], data_provider=provider)
    return werkzeug_test.Client(app)


def get_json(client, path):
    response = client.get(PREFIX + path)
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.headers["Content-Type"].startswith("application/json")
    return json.loads(response.get_data(as_text=True))


def test_runs(logdir):
    root, _ = logdir
    body = get_json(client_for(root), "/runs")
    # The vocabulary the page reads comes from Python's one definition.
    assert body["vocabulary"] == dashboard_schema.VOCABULARY
    assert body["vocabulary"]["leftover_policies"] == ["flush", "carry", "drop"]
    runs = body["runs"]
    assert [r["run"] for r in runs] == ["dropping", "flushing", "nonfinite"]
    assert runs[1] == {"run": "flushing", "updates": 12, "variables": 4,
                       "problems": []}
    assert runs[0]["updates"] == 9  # 3 updates per epoch, partial windows dropped


def test_series(logdir):
    root, callbacks = logdir
    body = get_json(client_for(root), "/series?run=flushing")
    assert body["steps"] == list(range(1, 13))
    assert body["sampled"] == callbacks["flushing"].optimizer_steps == 12
    series = body["series"]
    assert set(series) == {name for name, _ in dashboard_schema.UPDATE_SERIES}
    assert series["window_micro_batches"] == [4, 4, 4, 1] * 3
    assert all(len(v) == 12 for v in series.values())
    accumulators = body["accumulators"]
    names = accumulators["variables"]
    assert names == sorted(names) and len(names) == 4
    assert sorted(name.split("/")[1] for name in names) == ["bias", "bias", "kernel", "kernel"]
    assert len(accumulators["columns"]) == 12 and accumulators["columns"][0] == [1, 1]
    # Per variable norms combine to the applied global norm at each update.
    for column in range(12):
        combined = math.sqrt(sum(row[column] ** 2 for row in accumulators["values"]))
        assert combined == pytest.approx(series["applied_gradient_norm"][column], rel=1e-5)


def test_series_downsampling_keeps_ends_and_extremes(logdir):
    root, _ = logdir
    client = client_for(root)
    full = get_json(client, "/series?run=flushing")
    small = get_json(client, "/series?run=flushing&points=6&columns=3")
    assert len(small["steps"]) <= 6
    assert small["steps"][0] == 1 and small["steps"][-1] == 12
    norms = full["series"]["applied_gradient_norm"]
    assert max(norms) in small["series"]["applied_gradient_norm"]
    assert [c for c in small["accumulators"]["columns"]] == [[1, 4], [5, 8], [9, 12]]


def test_downsample_min_max_by_hand():
    values = [0, 5, 1, 1, -3, 1, 1, 9, 1, 2]
    keep = downsample_min_max(values, 6)
    assert keep[0] == 0 and keep[-1] == 9
    assert 4 in keep and 7 in keep  # the minimum and the maximum
    assert len(keep) <= 6
    assert downsample_min_max([1.0, math.nan, 2.0, 3.0, 4.0, 5.0], 3).count(1) == 1


def test_events_and_counters_match_the_callback(logdir):
    root, callbacks = logdir
    client = client_for(root)
    flushing = get_json(client, "/events?run=flushing")
    assert [e["policy"] for e in flushing["events"]] == ["flush"] * 3
    assert [e["step"] for e in flushing["events"]] == [4, 8, 12]
    assert flushing["events"][0] == {"step": 4, "policy": "flush", "micro_batches": 1, "samples": 4}
    for run in ("flushing", "dropping"):
        counters = get_json(client, f"/events?run={run}")["counters"]
        callback = callbacks[run]
        assert counters["optimizer_steps"] == callback.optimizer_steps
        assert counters["micro_steps"] == callback.micro_steps
        assert counters["skipped_updates"] == callback.micro_steps - callback.optimizer_steps
        assert counters["flushes"] == callback.flushes
        assert counters["dropped_micro_steps"] == callback.dropped_micro_steps
    assert callbacks["dropping"].dropped_micro_steps == 3


def test_non_finite_values_are_json_safe(logdir):
    root, _ = logdir
    response = get_json(client_for(root), "/series?run=nonfinite")  # parses as strict JSON
    norms = response["series"]["applied_gradient_norm"]
    assert norms[0] != "NaN" and isinstance(norms[0], float)
    assert "NaN" in norms or "Infinity" in norms


@pytest.mark.parametrize(
    "path, code, message",
    [
        ("/series", 400, "Missing required query parameter: run"),
        ("/events", 400, "Missing required query parameter: run"),
        ("/series?run=nope", 404, "No accumulation data for run 'nope'"),
        ("/events?run=nope", 404, "No accumulation data for run 'nope'"),
        ("/series?run=flushing&points=0", 400, "`points` must be an integer from 1 to 100000. Received: points='0'"),
        ("/series?run=flushing&columns=x", 400, "`columns` must be an integer from 1 to 100000. Received: columns='x'"),
    ],
)
def test_bad_requests(logdir, path, code, message):
    root, _ = logdir
    response = client_for(root).get(PREFIX + path)
    assert response.status_code == code
    assert message in response.get_data(as_text=True)


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """1,500 updates of the applied norm: more than the default 1,000 kept."""
    import tensorflow as tf

    root = tmp_path_factory.mktemp("long")
    meta = dashboard_schema.create_summary_metadata(dashboard_schema.Kind.APPLIED_GRADIENT_NORM)
    with tf.summary.create_file_writer(str(root / "long")).as_default():
        for step in range(1, 1501):
            tf.summary.write(dashboard_schema.TAG_PREFIX + "applied_gradient_norm",
                             tf.constant(1.0 + step % 7, tf.float32), step=step,
                             metadata=meta.SerializeToString())
    return root


@pytest.mark.parametrize("hint, expected", [(None, 1000), (5, 5), (0, 1500)])
def test_samples_per_plugin_is_honoured(long_run, hint, expected):
    """`--samples_per_plugin=accumulation=N` bounds what is read; 0 means all."""
    hints = {} if hint is None else {dashboard_schema.PLUGIN_NAME: hint}
    body = get_json(client_for(long_run, hints), "/series?run=long")
    assert body["sampled"] == expected


def test_static_files_and_frontend_metadata(logdir):
    root, _ = logdir
    client = client_for(root)
    response = client.get(PREFIX + "/index.js")
    assert response.status_code == 200
    assert "javascript" in response.headers["Content-Type"]
    assert "export" in response.get_data(as_text=True) and "render" in response.get_data(as_text=True)
    listing = json.loads(client.get("/data/plugins_listing").get_data(as_text=True))
    assert listing["accumulation"]["tab_name"] == "Accumulation"
    assert listing["accumulation"]["loading_mechanism"] == {
        "type": "IFRAME", "module_path": PREFIX + "/index.js"}


def test_plugin_imports_no_tensorflow():
    code = ("import sys, tb_plugin.loader, tb_plugin.plugin, tfaccum.dashboard_schema; "
            "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    (entry,) = [e for e in entry_points(group="tensorboard_plugins") if e.name == "accumulation"]
    assert entry.load() is AccumulationPluginLoader


def test_a_broken_plugin_does_not_crash_tensorboard(monkeypatch, caplog):
    import tb_plugin.plugin

    def broken(context):
        raise RuntimeError("boom")

    monkeypatch.setattr(tb_plugin.plugin, "AccumulationPlugin", broken)
    assert AccumulationPluginLoader().load(base_plugin.TBContext()) is None
    assert "failed to load; TensorBoard continues without it" in caplog.text


@pytest.mark.parametrize("load_fast", ["true", "false"])
def test_both_tensorboard_loaders_read_the_summaries(logdir, load_fast):
    from tensorboard_server import TensorBoard

    root, callbacks = logdir
    server = TensorBoard(root, f"--load_fast={load_fast}", "--reload_interval", "1")
    try:
        server.wait_started()
        expected = {"dropping": 9, "flushing": 12, "nonfinite": 4}

        def updates(tb):
            return {r["run"]: r["updates"] for r in tb.get_json(PREFIX[1:] + "/runs")["runs"]}

        server.wait_for(lambda tb: updates(tb) == expected, f"runs with updates {expected}")
        counters = server.get_json(PREFIX[1:] + "/events?run=flushing")["counters"]
        assert counters["micro_steps"] == callbacks["flushing"].micro_steps
        assert server.get_json(PREFIX[1:] + "/series?run=flushing")["steps"] == list(range(1, 13))
    finally:
        server.stop()


def test_loader_sets_a_sampling_default_without_overriding_the_user():
    import argparse

    for given, expected in (({}, 1000), ({"accumulation": 0}, 0), ({"accumulation": 50}, 50)):
        flags = argparse.Namespace(samples_per_plugin=dict(given))
        AccumulationPluginLoader().fix_flags(flags)
        assert flags.samples_per_plugin["accumulation"] == expected


class CountingProvider:
    """A data provider that counts its reads, around TensorBoard's own."""

    def __init__(self, inner):
        self._inner = inner
        self.reads = self.listings = 0

    def read_scalars(self, *args, **kwargs):
        self.reads += 1
        return self._inner.read_scalars(*args, **kwargs)

    def list_scalars(self, *args, **kwargs):
        self.listings += 1
        return self._inner.list_scalars(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_answers_are_kept_until_the_run_has_new_data(tmp_path):
    import threading

    import tensorflow as tf

    tag = dashboard_schema.TAG_PREFIX + "applied_gradient_norm"
    meta = dashboard_schema.create_summary_metadata(dashboard_schema.Kind.APPLIED_GRADIENT_NORM)

    def write(steps):
        with tf.summary.create_file_writer(str(tmp_path / "run")).as_default():
            for step in steps:
                tf.summary.write(tag, float(step), step=step, metadata=meta)

    write(range(1, 4))
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        tensor_size_guidance={dashboard_schema.PLUGIN_NAME: 0})
    multiplexer.AddRunsFromDirectory(str(tmp_path))
    multiplexer.Reload()
    counting = CountingProvider(data_provider.MultiplexerDataProvider(multiplexer, str(tmp_path)))
    plugin = AccumulationPlugin(base_plugin.TBContext(logdir=str(tmp_path),
                                                      data_provider=counting))
    now = [0.0]
    plugin._listings = cache.Listings(clock=lambda: now[0])  # a clock the test moves
    client = werkzeug_test.Client(application.TensorBoardWSGI([plugin], data_provider=counting))

    # 16 concurrent requests for a cold answer read the data once.
    bodies = []
    threads = [threading.Thread(target=lambda: bodies.append(get_json(client, "/series?run=run")))
               for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [b["steps"] for b in bodies] == [[1, 2, 3]] * 16
    reads = counting.reads
    assert reads == 1  # one read of the series: computed once
    assert get_json(client, "/series?run=run")["steps"] == [1, 2, 3]
    assert counting.reads == reads  # kept
    get_json(client, "/series?run=run&points=2")  # other parameters: another answer
    assert counting.reads > reads

    listings = counting.listings
    for _ in range(20):  # many requests within a second: listed once
        get_json(client, "/series?run=run")
    assert counting.listings == listings

    write(range(4, 6))  # the run grows; TensorBoard reloads
    multiplexer.Reload()
    assert get_json(client, "/series?run=run")["steps"] == [1, 2, 3]  # listed under a second ago
    now[0] += cache.LISTING_SECONDS
    assert get_json(client, "/series?run=run")["steps"] == [1, 2, 3, 4, 5]
    assert get_json(client, "/runs")["runs"][0]["updates"] == 5
