"""The dashboard's schema (`tfaccum.dashboard_schema`) and the generated code of accumulation.proto."""

import re
from pathlib import Path

from tfaccum import accumulation_pb2
from tfaccum import dashboard_schema

PROTO = Path(dashboard_schema.__file__).with_name("accumulation.proto").read_text()


def test_generated_code_matches_the_proto():
    """`make proto` was run after the last edit of accumulation.proto."""
    message = accumulation_pb2.AccumulationPluginData.DESCRIPTOR
    fields = dict(re.findall(r"^\s+(?:int32|string|Kind) (\w+) = (\d+);", PROTO, re.M))
    assert {f.name: str(f.number) for f in message.fields} == fields
    enum = dict(re.findall(r"^\s+([A-Z_]+) = (\d+);", PROTO, re.M))
    assert {v.name: str(v.number) for v in message.enum_types_by_name["Kind"].values} == enum


def test_summary_metadata_round_trip():
    meta = dashboard_schema.create_summary_metadata(dashboard_schema.Kind.ACCUMULATOR_NORM, variable="dense/kernel")
    assert meta.plugin_data.plugin_name == "accumulation"
    assert meta.data_class == dashboard_schema.summary_pb2.DATA_CLASS_SCALAR
    assert meta.summary_description
    content = dashboard_schema.parse_plugin_metadata(meta.plugin_data.content)
    assert (content.version, content.kind, content.variable) == (
        dashboard_schema.PROTO_VERSION, dashboard_schema.Kind.ACCUMULATOR_NORM, "dense/kernel")


def test_every_kind_has_a_description():
    kinds = accumulation_pb2.AccumulationPluginData.Kind
    for name in kinds.keys():
        if name != "KIND_UNSPECIFIED":
            dashboard_schema.create_summary_metadata(kinds.Value(name))  # no KeyError


def test_the_advisor_rule_is_defined_once():
    # Halves round up, as the page's Math.round does (Python's round() would
    # give 2 here).
    assert dashboard_schema.suggested_accumulation_steps(20.0, 8.0) == 3
    assert dashboard_schema.suggested_accumulation_steps(3.0, 8.0) == 1
    assert dashboard_schema.suggested_accumulation_steps(None, 8.0) is None
    assert dashboard_schema.suggested_accumulation_steps(-5.0, 8.0) is None
    band = dashboard_schema.ADVICE_BAND
    assert dashboard_schema.batch_advice(band * 10 + 1, 10) == "less"
    assert dashboard_schema.batch_advice(band * 10, 10) == "good"
    assert dashboard_schema.batch_advice(10 / band - 1, 10) == "more"
    assert dashboard_schema.VOCABULARY["advice_band"] == band
    assert dashboard_schema.VOCABULARY["leftover_policies"] == list(dashboard_schema.LEFTOVER_POLICIES)
