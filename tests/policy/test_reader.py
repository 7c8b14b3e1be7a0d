"""The bounded reading layer: each limit at its boundary, and what stays allowed."""

from __future__ import annotations

import pytest

from proxima.policy.reader import MAX_DEPTH, MAX_NODES, MAX_POLICY_BYTES, ReadError, read_json, read_yaml


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("read", [read_yaml, read_json])
def test_depth_limit_is_exact(read) -> None:  # type: ignore[no-untyped-def]
    read(_nested(MAX_DEPTH))
    with pytest.raises(ReadError) as info:
        read(_nested(MAX_DEPTH + 1))
    assert info.value.kind == "depth" and (info.value.line, info.value.column) == (1, MAX_DEPTH + 1)


def test_json_brackets_inside_strings_do_not_count() -> None:
    assert read_json('{"a": "' + "[" * 100 + '\\"' + "{" * 100 + '"}') == {"a": "[" * 100 + '"' + "{" * 100}


@pytest.mark.parametrize("read", [read_yaml, read_json])
def test_size_limit_is_exact(read) -> None:  # type: ignore[no-untyped-def]
    body = '"' + "x" * (MAX_POLICY_BYTES - 2) + '"'
    assert len(read_json(body.encode()) if read is read_json else read_yaml(body.encode())[0]) == MAX_POLICY_BYTES - 2
    with pytest.raises(ReadError) as info:
        read((body + " ").encode())
    assert info.value.kind == "too_large" and str(MAX_POLICY_BYTES + 1) in info.value.message
    with pytest.raises(ReadError, match="is longer than that"):
        read(body + "  ")  # a str: refused from its length, before encoding


def test_node_limit_counts_aliases_at_their_expanded_size() -> None:
    ten = "[" + ", ".join(["1"] * 9) + "]"  # 10 nodes
    uses = MAX_NODES // 10 - 2
    ok = f"a: &t {ten}\nb: [" + ", ".join(["*t"] * uses) + "]\n"
    data, _ = read_yaml(ok)
    assert len(data["b"]) == uses
    with pytest.raises(ReadError) as info:
        read_yaml(f"a: &t {ten}\nb: [" + ", ".join(["*t"] * (uses + 5)) + "]\n")
    assert info.value.kind == "aliases" and "alias *t expands the policy past" in info.value.message
    assert info.value.line == 2


def test_node_limit_without_aliases() -> None:
    with pytest.raises(ReadError) as info:
        read_yaml("[" + ", ".join(["1"] * MAX_NODES) + "]")
    assert info.value.kind == "too_large" and f"more than {MAX_NODES} values" in info.value.message


def test_merge_keys_may_override_but_plain_keys_may_not_repeat() -> None:
    data, _ = read_yaml("base: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\n")
    assert data["c"] == {"x": 3, "y": 2}
    with pytest.raises(ReadError) as info:
        read_yaml("bands:\n  - name: a\n    name: b\n")
    assert info.value.kind == "duplicate_key" and info.value.path == "bands[0].name"
    assert info.value.line == 3 and "first at line 2" in info.value.message


def test_json_duplicate_key_has_its_field_path() -> None:
    with pytest.raises(ReadError) as info:
        read_json('{"bands": [{"name": "a"}, {"name": "a", "name": "b"}]}')
    assert info.value.kind == "duplicate_key" and info.value.path == "bands[1].name"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"a": NaN}', "NaN is not a number JSON allows"),
        ('{"a": -Infinity}', "-Infinity is not a number JSON allows"),
        ('{"a": ' + "9" * 5000 + "}", "Exceeds the limit"),
        ('{"a": 1,}', "invalid JSON"),
    ],
)
def test_json_refusals(text: str, message: str) -> None:
    with pytest.raises(ReadError, match=message) as info:
        read_json(text)
    assert info.value.kind == "syntax"


def test_yaml_huge_integer_is_located() -> None:
    with pytest.raises(ReadError) as info:
        read_yaml("a: 1\nb: " + "9" * 5000 + "\n")
    assert (info.value.line, info.value.column) == (2, 4) and "not a usable integer" in info.value.message


def test_yaml_unsafe_tags_are_refused() -> None:
    with pytest.raises(ReadError, match="could not determine a constructor") as info:
        read_yaml("a: !!python/object/apply:os.system ['true']\n")
    assert info.value.line == 1


def test_empty_document() -> None:
    assert read_yaml("") == (None, None)
    assert read_yaml("# only a comment\n") == (None, None)
