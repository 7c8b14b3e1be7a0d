from pathlib import Path

import pytest
import yaml

from proxima.formats import Format
from proxima.policy.loader import PolicyError, dump_policy, load_policy, parse_policy
from proxima.policy.schema import Policy

CONFIGS = sorted((Path(__file__).parents[2] / "proxima" / "policies").glob("*.yaml"))

GOOD = """\
schema_version: 1
name: t
bands:
  - name: a
    enter: 0.7
    exit: 0.5
    target_free: 0.4
    ladder: [int8, int4]
"""


def test_shipped_configs_exist_and_validate() -> None:
    names = {p.stem for p in CONFIGS}
    assert {"off", "conservative", "balanced", "aggressive"} <= names
    for path in CONFIGS:
        policy = load_policy(path)
        assert policy.name == path.stem


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_round_trip(path: Path) -> None:
    policy = load_policy(path)
    again = parse_policy(dump_policy(policy))
    assert again == policy
    assert Policy.model_validate_json(policy.model_dump_json()) == policy


def test_formats_parsed_in_ladder() -> None:
    policy = parse_policy(GOOD)
    assert policy.bands[0].ladder == [Format.parse("int8"), Format.parse("int4")]


def _problem(text: str):
    with pytest.raises(PolicyError) as info:
        parse_policy(text, source="p.yaml")
    return info.value.problems


def test_wrong_type_names_line_and_field() -> None:
    [p] = _problem(GOOD.replace("enter: 0.7", "enter: high"))
    assert (p.line, p.field) == (5, "bands[0].enter")
    assert str(p).startswith("p.yaml:5:12: bands[0].enter:")


def test_unknown_key_points_at_key() -> None:
    [p] = _problem(GOOD + "protect:\n  sink_tokenz: 4\n")
    assert (p.line, p.column, p.field) == (10, 3, "protect.sink_tokenz")
    assert "unknown key" in p.message


def test_exit_above_enter() -> None:
    [p] = _problem(GOOD.replace("exit: 0.5", "exit: 0.9"))
    assert p.field == "bands[0]" and p.line == 4
    assert "exit (0.9) must be <= enter (0.7)" in p.message


def test_unknown_format() -> None:
    [p] = _problem(GOOD.replace("[int8, int4]", "[int8, int3]"))
    assert p.field == "bands[0].ladder[1]" and p.line == 8
    assert "unknown format 'int3'" in p.message


def test_empty_ladder() -> None:
    [p] = _problem(GOOD.replace("[int8, int4]", "[]"))
    assert p.field == "bands[0].ladder" and "at least 1" in p.message


def test_invalid_yaml() -> None:
    [p] = _problem("bands: [\n  - x: 1\n")
    assert p.line is not None and "invalid YAML" in p.message


def test_several_problems_all_reported() -> None:
    problems = _problem(GOOD.replace("enter: 0.7", "enter: 2").replace("target_free: 0.4", "target_free: 0"))
    assert {p.field for p in problems} == {"bands[0].enter", "bands[0].target_free"}


def test_bands_must_rise() -> None:
    text = GOOD + "  - name: b\n    enter: 0.6\n    exit: 0.5\n    target_free: 0.5\n    ladder: [int4]\n"
    [p] = _problem(text)
    assert "strictly rising" in p.message


def test_layer_override_requires_equal_ratio() -> None:
    [p] = _problem(GOOD + "layer_overrides:\n  - layers: [0]\n    substitute: {int4: int8}\n")
    assert p.field == "layer_overrides[0].substitute" and "same in every layer" in p.message
    ok = parse_policy(GOOD + "layer_overrides:\n  - layers: [0]\n    substitute: {'sparse(4)': int4}\n")
    assert ok.layer_format(Format.parse("sparse(4)"), 0) == Format.parse("int4")
    assert ok.layer_format(Format.parse("sparse(4)"), 1) == Format.parse("sparse(4)")


def test_band_target_must_exceed_entry_free_fraction() -> None:
    [p] = _problem(GOOD.replace("target_free: 0.4", "target_free: 0.2"))
    assert p.field == "bands[0]" and "never compresses" in p.message


def test_not_a_mapping() -> None:
    [p] = _problem("- 1\n- 2\n")
    assert "mapping" in p.message


def test_json_schema_is_valid_json_schema() -> None:
    schema = Policy.model_json_schema()
    assert schema["type"] == "object"
    band = schema["$defs"]["Band"]
    assert band["properties"]["ladder"]["items"]["type"] == "string"
    assert band["additionalProperties"] is False
    yaml.safe_dump(schema)  # serialisable


def test_storage_group_size_defaults_to_32_and_is_read() -> None:
    assert parse_policy(GOOD).storage.group_size == 32
    assert parse_policy(GOOD + "storage:\n  group_size: 64\n").storage.group_size == 64
    st = parse_policy(GOOD + "storage:\n  group_size: 64\n  group_sizes: {int2: 32}\n").storage
    assert [st.group_for(Format.parse(f)) for f in ("int8", "int4", "cluster(2)+int4", "int2")] == [64, 64, 64, 32]
    assert (st.field_for(Format.parse("int2")), st.field_for(Format.parse("int4"))) == (
        "storage.group_sizes.int2", "storage.group_size")


def test_storage_group_sizes_are_powers_of_two_of_known_quantizations() -> None:
    [p] = _problem(GOOD + "storage:\n  group_sizes: {int4: 48}\n")
    assert p.field == "storage.group_sizes" and "{'int4': 48}" in p.message
    [p] = _problem(GOOD + "storage:\n  group_sizes: {int3: 64}\n")
    assert p.field.startswith("storage.group_sizes")


@pytest.mark.parametrize("bad", ["48", "0", "'64'"])
def test_storage_group_size_must_be_a_power_of_two(bad: str) -> None:
    [p] = _problem(GOOD + f"storage:\n  group_size: {bad}\n")
    assert p.field == "storage.group_size" and p.source == "p.yaml" and p.line == 10


MERGING = GOOD.replace("[int8, int4]", '[int4, "cluster(2)+int4"]')


def test_merged_tokens_parse_and_default_to_todays_merge() -> None:
    assert parse_policy(MERGING).protect.merged_tokens == 0
    p = parse_policy(MERGING + "protect:\n  merged_tokens: 2\n  merged_by: outlier\n")
    assert (p.protect.merged_tokens, p.protect.merged_by) == (2, "outlier")


@pytest.mark.parametrize(("value", "field"), [
    ("merged_tokens: -1", "protect.merged_tokens"),
    ("merged_tokens: two", "protect.merged_tokens"),
    ("merged_tokens: true", "protect.merged_tokens"),
    ("merged_by: norm", "protect.merged_by"),
])
def test_bad_merged_tokens_name_their_field(value: str, field: str) -> None:
    [p] = _problem(MERGING + f"protect:\n  {value}\n")
    assert p.field == field and p.line == 10  # the line of the value (protect: is line 9)


def test_merged_tokens_without_a_merging_rung_is_an_error_naming_the_field() -> None:
    [p] = _problem(GOOD + "protect:\n  merged_tokens: 2\n")
    assert "protect.merged_tokens: 2" in p.message and "cluster" in p.message
    # a layer override that stores a merge in some layers is enough
    text = GOOD.replace("[int8, int4]", "[int8, sparse(4)]") + (
        "protect:\n  merged_tokens: 2\nlayer_overrides:\n  - layers: [0]\n    substitute: {sparse(4): cluster(4)}\n")
    assert parse_policy(text).protect.merged_tokens == 2
