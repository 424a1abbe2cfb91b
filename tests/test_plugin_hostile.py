"""The dashboard's routes against hostile logs: one bad run never blanks the others.

Event files written by hand, as older versions, killed jobs and other tools
leave them: undecodable plugin metadata, leftover policies out of range,
non-finite counters, non-scalar and non-float tensors under accumulation
tags. Every route answers (never 500), skips what it cannot read, and says
so in the JSON, for that run only.
"""

import json
import math
import urllib.error
import urllib.request

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.compat.proto import summary_pb2

from reference import make_data
from reference import make_model
from tensorboard_server import TensorBoard
from test_plugin import PREFIX
from test_plugin import client_for
from test_plugin import get_json

from tfaccum import dashboard_schema
from tfaccum import GradientAccumulationCallback

# Its module-scoped fixtures are built once: its tests share a worker.
pytestmark = pytest.mark.xdist_group("test_plugin_hostile")


def write(log_dir, tag, values, meta):
    """Writes `values` (one per step, from 1) under `tag` with `meta` (bytes)."""
    with tf.summary.create_file_writer(str(log_dir)).as_default():
        for step, value in enumerate(values, start=1):
            tf.summary.write(tag, value, step=step, metadata=meta)


def accumulation_meta(kind):
    return dashboard_schema.create_summary_metadata(kind).SerializeToString()


GARBAGE_META = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(
        plugin_name=dashboard_schema.PLUGIN_NAME, content=b"\xff\xfe not a proto \x00\x01"),
    data_class=summary_pb2.DATA_CLASS_SCALAR,
).SerializeToString()


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A good run (the real callback) beside hostile ones."""
    root = tmp_path_factory.mktemp("hostile")
    x, y = make_data()
    make_model().fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
        GradientAccumulationCallback(accumulation_steps=4, log_dir=str(root / "good"))])
    applied = dashboard_schema.TAG_PREFIX + "applied_gradient_norm"
    one = [tf.constant(1.0)] * 3
    # Undecodable plugin metadata, beside a readable series of the same run.
    write(root / "garbage", applied, one, accumulation_meta(dashboard_schema.Kind.APPLIED_GRADIENT_NORM))
    write(root / "garbage", dashboard_schema.TAG_PREFIX + "micro_norm_max", one, GARBAGE_META)
    # Leftover policies out of range, and a non-finite counter.
    policies = [7.0, 1e30, float("nan"), float("inf"), -1.0, 0.0]
    write(root / "policies", applied, [tf.constant(1.0)] * 6,
          accumulation_meta(dashboard_schema.Kind.APPLIED_GRADIENT_NORM))
    write(root / "policies", dashboard_schema.TAG_PREFIX + "leftover/policy",
          [tf.constant(p, tf.float32) for p in policies], accumulation_meta(dashboard_schema.Kind.LEFTOVER_POLICY))
    write(root / "policies", dashboard_schema.TAG_PREFIX + "micro_steps",
          [tf.constant(v, tf.float32) for v in (4.0, 8.0, float("nan"), 12.0, 16.0, float("nan"))],
          accumulation_meta(dashboard_schema.Kind.MICRO_STEPS))
    # Tensors that are no float scalars, under accumulation tags.
    write(root / "shapes", applied, one, accumulation_meta(dashboard_schema.Kind.APPLIED_GRADIENT_NORM))
    for name, value in (("micro_norm_mean", tf.constant([1.0, 2.0, 3.0])),
                        ("micro_norm_max", tf.zeros((0,))),
                        ("window_samples", tf.ones((2, 2))),
                        ("micro_steps", tf.constant("text")),
                        ("skipped_updates", tf.constant(3, tf.int64)),
                        ("nonfinite_skips", tf.constant(1 + 2j, tf.complex64))):
        write(root / "shapes", dashboard_schema.TAG_PREFIX + name, [value] * 3, accumulation_meta(
            dict(dashboard_schema.UPDATE_SERIES)[name]))
    return root


def problems(body):
    return [p["reason"] for p in body.get("problems", [])]


def test_runs_list_every_readable_run_and_report_the_rest(hostile):
    body = get_json(client_for(hostile), "/runs")
    runs = {r["run"]: r for r in body["runs"]}
    assert runs["good"]["updates"] == 8 and runs["good"]["problems"] == []
    assert runs["garbage"]["updates"] == 3
    (problem,) = runs["garbage"]["problems"]
    assert problem["tag"] == dashboard_schema.TAG_PREFIX + "micro_norm_max"
    assert "cannot be decoded" in problem["reason"]


def test_events_skip_what_is_out_of_range(hostile):
    body = get_json(client_for(hostile), "/events?run=policies")
    assert [e["policy"] for e in body["events"]] == ["flush"]  # only the 0 at step 6
    reasons = problems(body)
    assert len([r for r in reasons if "leftover policy" in r]) == 5  # 7, 1e30, NaN, inf, -1
    assert body["counters"]["micro_steps"] is None  # the last one is NaN: reported, not 500
    assert any("micro_steps" in r for r in reasons)


def test_non_scalar_tensors_are_skipped_and_reported(hostile):
    client = client_for(hostile)
    series = get_json(client, "/series?run=shapes")
    assert series["sampled"] == 3 and series["steps"] == [1, 2, 3]
    skipped = " ".join(problems(series))
    for name in ("micro_norm_mean", "micro_norm_max", "window_samples", "micro_steps",
                 "nonfinite_skips"):
        assert name in skipped, name
    assert all(v is None for v in series["series"]["micro_norm_mean"])
    events = get_json(client, "/events?run=shapes")
    assert events["counters"]["optimizer_steps"] == 3


def http(url, method="GET"):
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.fixture(scope="module", params=["true", "false"], ids=["rustboard", "python-loader"])
def served(hostile, request):
    tb = TensorBoard(hostile, f"--load_fast={request.param}", "--reload_interval=1")
    try:
        tb.wait_started()
        tb.wait_for(lambda t: len(t.get_json(PREFIX[1:] + "/runs")["runs"]) >= 2, "the runs")
        yield tb
    finally:
        tb.stop()


def test_no_route_answers_500_through_tensorboard(served):
    runs = served.get_json(PREFIX[1:] + "/runs")
    names = {r["run"] for r in runs["runs"]}
    assert "good" in names and "garbage" in names
    for run in sorted(names):
        for route in ("series", "events"):
            status, body = http(f"{served.url}{PREFIX[1:]}/{route}?run={run}")
            assert status == 200, (run, route, body[:300])
            json.loads(body)
    good = served.get_json(PREFIX[1:] + "/series?run=good")
    assert good["sampled"] == 8 and not math.isnan(float(good["series"]["applied_gradient_norm"][0]))


def test_methods_and_static_paths(served):
    base = served.url + PREFIX[1:]
    for method in ("POST", "PUT", "DELETE", "PATCH", "TRACE"):
        status, _ = http(base + "/runs", method)
        assert status == 405, method
    assert http(base + "/index.js")[0] == 200
    for path in ("/index.js/", "/static/../plugin.py", "/nothing.js"):
        assert http(base + path)[0] == 404, path


def test_werkzeug_routes_refuse_other_methods(hostile):
    client = client_for(hostile)
    assert client.post(PREFIX + "/runs").status_code == 405
    assert client.get(PREFIX + "/index.js/").status_code == 404
    assert client.delete(PREFIX + "/index.js").status_code == 405
    np.testing.assert_equal(client.get(PREFIX + "/runs").status_code, 200)
