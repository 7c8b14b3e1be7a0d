"""Reading policy text from untrusted places (files, API bodies) within fixed bounds.

Every policy that enters Proxima, from a file, a hot reload or an HTTP body, is read here first,
so one set of limits holds everywhere. Each limit is checked before the work it protects:

- size: at most `MAX_POLICY_BYTES`, checked before decoding (a file is never read past it);
- encoding: strict UTF-8, a bad byte reported with its line and column;
- nesting: at most `MAX_DEPTH` levels of lists and mappings, counted while the YAML node tree is
  composed (JSON: while scanning brackets, before `json.loads` recurses);
- aliases: YAML anchors may be reused, but the tree they expand to is at most `MAX_NODES` nodes,
  counted at compose time from each anchored node's expanded size, so a "billion laughs" bomb
  is refused after a few thousand nodes of work; an alias to its own ancestor is refused;
- duplicate keys are an error (with both lines), never "the last one wins";
- JSON: NaN / Infinity literals are refused; numbers that overflow to infinity reach pydantic,
  whose policy models refuse non-finite values with the field path.

A policy needs none of what these limits refuse: the shipped ones are about 2 KB, 4 levels deep
and a few hundred nodes. Problems are `ReadError`s; callers turn them into `PolicyError`s (with
the file name) or HTTP errors (400, or 413 for size).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal, cast

import yaml
from yaml.events import AliasEvent, MappingStartEvent, SequenceStartEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_POLICY_BYTES = 256 * 1024
"""Largest policy text accepted (bytes). The shipped policies are about 2 KB."""
MAX_DEPTH = 32
"""Deepest nesting of lists and mappings. The policy schema itself is at most 4 levels deep."""
MAX_NODES = 10_000
"""Most YAML nodes after alias expansion (keys, values and list items each count one)."""

ReadErrorKind = Literal["too_large", "encoding", "syntax", "depth", "aliases", "duplicate_key"]


class ReadError(ValueError):
    """Policy text that cannot be read safely; `line`/`column` are 1-based when known."""

    def __init__(
        self,
        kind: ReadErrorKind,
        message: str,
        line: int | None = None,
        column: int | None = None,
        path: str = "",
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.line = line
        self.column = column
        self.path = path
        """Field path of the problem (e.g. `protect.enabled` for a duplicate key), when known."""

    @classmethod
    def at(cls, kind: ReadErrorKind, message: str, mark: Any, path: str = "") -> ReadError:
        """Located at a PyYAML mark (0-based line and column), if there is one."""
        if mark is None:
            return cls(kind, message, path=path)
        return cls(kind, message, mark.line + 1, mark.column + 1, path)


# -- bytes -> text ------------------------------------------------------------------------------
def _too_large(size: int | None) -> ReadError:
    got = f"is {size} bytes" if size is not None else "is longer than that"
    return ReadError("too_large", f"policy text is limited to {MAX_POLICY_BYTES} bytes; this one {got}")


def read_bounded(path: str | Path) -> bytes:
    """A file's bytes, refusing it (before reading) when it exceeds `MAX_POLICY_BYTES`.

    The read itself stops at the limit + 1 byte too, so a file that grows meanwhile, or a pipe or
    device with no size (/dev/zero), costs no more. Raises `OSError` when it cannot be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_POLICY_BYTES:
            raise _too_large(size)
        data = f.read(MAX_POLICY_BYTES + 1)
    if len(data) > MAX_POLICY_BYTES:
        raise _too_large(None)
    return data


def _line_column(text: str | bytes, offset: int) -> tuple[int, int]:
    newline = "\n" if isinstance(text, str) else b"\n"
    line = text.count(newline, 0, offset) + 1  # type: ignore[arg-type]
    return line, offset - (text.rfind(newline, 0, offset) + 1) + 1  # type: ignore[arg-type]


def decode(data: bytes | str) -> str:
    """Size check, then strict UTF-8 decoding (a str is only size-checked, as UTF-8)."""
    if isinstance(data, str):
        # Every character is at least one byte: a longer str is over the limit without encoding it.
        if len(data) > MAX_POLICY_BYTES:
            raise _too_large(None)
        if len(data) * 4 > MAX_POLICY_BYTES and len(data.encode("utf-8", "surrogatepass")) > MAX_POLICY_BYTES:
            raise _too_large(None)
        return data
    if len(data) > MAX_POLICY_BYTES:
        raise _too_large(len(data))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = _line_column(data, exc.start)
        raise ReadError(
            "encoding",
            f"not UTF-8: byte 0x{data[exc.start]:02x} at line {line}, column {column} cannot be decoded "
            "(save the file as UTF-8)",
            line,
            column,
        ) from None


# -- YAML ---------------------------------------------------------------------------------------
class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the limits above enforced while the node tree is composed.

    `compose_node` is PyYAML's recursive entry point for every node (aliases included), so
    counting there sees the document in order, and stops it as soon as a limit is crossed.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._depth = 0
        self._expanded = 0  # nodes composed so far, every alias counted at its expanded size
        self._size: dict[int, int] = {}  # id(node) -> expanded size, once the node is complete

    def compose_node(self, parent: Node | None, index: Any) -> Node:  # type: ignore[override]
        event: Any = self.peek_event()  # typeshed: Event | None; a node always starts with an event
        if isinstance(event, AliasEvent):
            target = self.anchors.get(event.anchor)
            if target is not None and id(target) not in self._size:
                raise ReadError.at(
                    "aliases",
                    f"alias *{event.anchor} refers to a node that contains it (a recursive structure)",
                    event.start_mark,
                )
            node = cast(Node, super().compose_node(parent, index))  # undefined aliases raise here
            self._count(self._size[id(node)], event)
            return node
        collection = isinstance(event, (SequenceStartEvent, MappingStartEvent))
        if collection:
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise ReadError.at(
                    "depth",
                    f"nested more than {MAX_DEPTH} levels deep (a policy needs at most 4)",
                    event.start_mark,
                )
        before = self._expanded
        node = cast(Node, super().compose_node(parent, index))
        if collection:
            self._depth -= 1
        self._count(1, event)
        self._size[id(node)] = self._expanded - before
        return node

    def _count(self, nodes: int, event: Any) -> None:
        self._expanded += nodes
        if self._expanded > MAX_NODES:
            alias = isinstance(event, AliasEvent)
            raise ReadError.at(
                "aliases" if alias else "too_large",
                f"alias *{event.anchor} expands the policy past {MAX_NODES} values (aliases are expanded "
                "for validation; a policy needs a few hundred)"
                if alias
                else f"the policy has more than {MAX_NODES} values (a policy needs a few hundred)",
                event.start_mark,
            )

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:  # type: ignore[override]
        # Checked before SafeConstructor merges `<<` keys, whose overriding is intended.
        first: dict[Any, Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, ScalarNode):
                continue
            key = self.construct_object(key_node)
            try:
                seen = first.get(key)
            except TypeError:  # unhashable: SafeConstructor reports it
                continue
            if seen is not None:
                raise ReadError.at(
                    "duplicate_key",
                    f"duplicate key {key_node.value!r} (first at line {seen.start_mark.line + 1}); "
                    "YAML keeps only one of them, so remove the other",
                    key_node.start_mark,
                    _path_to(self._root, key_node),
                )
            first[key] = key_node
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: ScalarNode) -> int:  # type: ignore[override]
        try:
            return super().construct_yaml_int(node)  # type: ignore[no-any-return]
        except ValueError as exc:  # more digits than Python converts (sys.int_max_str_digits)
            reason = str(exc).split(":")[0]
            raise ReadError.at("syntax", f"not a usable integer: {reason}", node.start_mark) from None

    _root: Node | None = None
    """The document's root node, set before construction (for field paths in messages)."""


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _path_to(root: Node | None, target: Node) -> str:
    """The field path (`a.b[2].c`) of `target` inside `root`, for messages ('' if not found)."""
    stack: list[tuple[Node, str]] = [(root, "")] if root is not None else []
    while stack:  # bounded: the tree was composed within MAX_NODES
        node, path = stack.pop()
        if isinstance(node, MappingNode):
            for key, value in node.value:
                name = f"{path}.{key.value}" if path else str(key.value)
                if key is target:
                    return name
                stack.append((value, name))
        elif isinstance(node, SequenceNode):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))
    return ""


def _yaml_problem(exc: yaml.YAMLError, text: str) -> ReadError:
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow (e.g. NUL)
        line, column = _line_column(text, exc.position)
        return ReadError("syntax", f"invalid YAML: character #x{exc.character:04x} is not allowed", line, column)
    msg = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    if context:
        msg = f"{msg} ({context})"
    return ReadError.at("syntax", f"invalid YAML: {msg}", getattr(exc, "problem_mark", None))


def read_yaml(data: bytes | str) -> tuple[Any, Node | None]:
    """Parse one YAML (or JSON) document within the limits: `(plain data, node tree)`.

    The node tree remembers where every key and value starts, for error messages. An empty
    document gives `(None, None)`. Raises `ReadError`.
    """
    text = decode(data)
    loader: _BoundedLoader | None = None
    try:
        loader = _BoundedLoader(text)  # checks the characters: may raise ReaderError
        node = loader.get_single_node()
        if node is None:
            return None, None
        loader._root = node
        return loader.construct_document(node), node
    except yaml.YAMLError as exc:
        raise _yaml_problem(exc, text) from None
    except RecursionError:  # not reachable within MAX_DEPTH; a last guard, never a traceback
        raise ReadError("depth", f"nested more than {MAX_DEPTH} levels deep") from None
    finally:
        if loader is not None:
            loader.dispose()


# -- JSON ---------------------------------------------------------------------------------------
# One JSON string, or one bracket outside strings. Strings are matched whole so brackets inside
# them do not count; the alternatives cannot overlap, so matching is linear.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _check_json_depth(text: str) -> None:
    depth = 0
    for m in _JSON_TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                line, column = _line_column(text, m.start())
                raise ReadError("depth", f"nested more than {MAX_DEPTH} levels deep", line, column)
        elif c in "]}":
            depth -= 1


class _Duplicate:
    """Stands in for a JSON object with a repeated key until the whole body is parsed, so the
    error can carry the object's field path (json's hook sees objects innermost first)."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any] | _Duplicate:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            return _Duplicate(key)
        out[key] = value
    return out


def _find_duplicate(data: Any) -> tuple[str, str] | None:
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:  # bounded by the body size; depth was checked before parsing
        value, path = stack.pop()
        if isinstance(value, _Duplicate):
            return path, value.key
        if isinstance(value, dict):
            stack.extend((v, f"{path}.{k}" if path else k) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def read_json(data: bytes | str) -> Any:
    """Parse one JSON value within the limits. Raises `ReadError`."""
    text = decode(data)
    _check_json_depth(text)
    try:
        value = json.loads(text, object_pairs_hook=_object, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ReadError("syntax", f"invalid JSON: {exc.msg}", exc.lineno, exc.colno) from None
    except (ValueError, RecursionError) as exc:  # NaN/Infinity literals, integers too long to convert
        raise ReadError("syntax", f"invalid JSON: {exc}") from None
    found = _find_duplicate(value)
    if found is not None:
        path, key = found
        field = f"{path}.{key}" if path else key
        raise ReadError(
            "duplicate_key", f"duplicate key {key!r}; JSON parsers keep only one of them, so remove the other",
            path=field,
        )
    return value


__all__ = [
    "MAX_DEPTH",
    "MAX_NODES",
    "MAX_POLICY_BYTES",
    "ReadError",
    "decode",
    "read_bounded",
    "read_json",
    "read_yaml",
]
