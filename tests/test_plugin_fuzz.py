"""The dashboard's reader against event files drawn at random (Hypothesis).

Each case writes runs whose accumulation tags hold whatever an event file can:
real numbers, NaN and infinities, huge values, integers, strings, vectors,
complex numbers; plugin metadata of the right kind, of another kind, or
undecodable; steps in any order, repeated. Every route must answer 200 with
valid JSON (no NaN literal) that lists what it skipped, for every run.
"""

import json

import tensorflow as tf
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from test_plugin import PREFIX
from test_plugin import client_for
from test_plugin_hostile import GARBAGE_META

from tfaccum import dashboard_schema

TAGS = ([dashboard_schema.TAG_PREFIX + name for name, _ in dashboard_schema.UPDATE_SERIES]
        + [dashboard_schema.TAG_PREFIX + name for name, _ in dashboard_schema.LEFTOVER_SERIES]
        + [dashboard_schema.ACCUMULATOR_PREFIX + "dense/kernel"])
KINDS = dict(dashboard_schema.UPDATE_SERIES + dashboard_schema.LEFTOVER_SERIES)

values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32).map(lambda v: tf.constant(v, tf.float32)),
    st.sampled_from([1e30, -1.0, 0.0, 7.0, 2.0**40]).map(lambda v: tf.constant(v, tf.float32)),
    st.integers(-2**40, 2**40).map(lambda v: tf.constant(v, tf.int64)),
    st.text(max_size=4).map(tf.constant),
    st.lists(st.floats(-1e3, 1e3, width=32), max_size=3).map(
        lambda v: tf.constant(v, tf.float32, shape=(len(v),))),
    st.just(tf.constant(1 + 2j, tf.complex64)),
)


def meta_for(tag, choice):
    if choice == "garbage":
        return GARBAGE_META
    if tag.startswith(dashboard_schema.ACCUMULATOR_PREFIX):
        kind = dashboard_schema.Kind.ACCUMULATOR_NORM
        extra = {"variable": tag[len(dashboard_schema.ACCUMULATOR_PREFIX):]}
    else:
        kind, extra = KINDS[tag[len(dashboard_schema.TAG_PREFIX):]], {}
    if choice == "other kind":
        kind, extra = dashboard_schema.Kind.LEFTOVER_POLICY, {}
    return dashboard_schema.create_summary_metadata(kind, **extra).SerializeToString()


series = st.tuples(
    st.sampled_from(TAGS),
    st.sampled_from(["right kind", "other kind", "garbage"]),
    st.lists(st.tuples(st.integers(0, 50), values), min_size=1, max_size=6),
)
runs = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.lists(series, min_size=1, max_size=5),
                       min_size=1, max_size=2)


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(runs)
def test_every_route_answers_json_whatever_the_event_files_hold(tmp_path_factory, drawn):
    root = tmp_path_factory.mktemp("drawn")
    for run, tags in drawn.items():
        with tf.summary.create_file_writer(str(root / run)).as_default():
            for tag, choice, points in tags:
                for step, value in points:
                    tf.summary.write(tag, value, step=step, metadata=meta_for(tag, choice))
    client = client_for(root)
    listed = answer(client, "/runs")
    assert isinstance(listed["runs"], list)
    for entry in listed["runs"]:
        assert isinstance(entry["problems"], list)
        for route in ("series", "events"):
            body = answer(client, f"/{route}?run={entry['run']}")
            assert body["run"] == entry["run"] and isinstance(body["problems"], list)
            if route == "series":
                assert len(body["steps"]) == len(set(body["steps"]))
                for name, column in body["series"].items():
                    assert len(column) == len(body["steps"]), name


def answer(client, path):
    response = client.get(PREFIX + path)
    text = response.get_data(as_text=True)
    assert response.status_code == 200, text
    return json.loads(text, parse_constant=_no_constants)


def _no_constants(name):
    raise AssertionError(f"JSON holds {name}, which JSON has not")

