"""Reading policy files: YAML -> `Policy`, with errors that point at file:line:column and field path.

`proxima.policy.reader` reads the text within fixed limits into a node tree (which remembers
where every key and value starts) and plain data for pydantic. A pydantic error location such as
`('bands', 1, 'exit')` is walked down the node tree to find the line the user must edit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from proxima.policies import POLICY_DIR
from proxima.policy.reader import ReadError, read_bounded, read_yaml
from proxima.policy.schema import Policy


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a policy, and where."""

    source: str
    line: int | None
    column: int | None
    field: str
    message: str

    def __str__(self) -> str:
        where = self.source
        if self.line is not None:
            where += f":{self.line}:{self.column or 1}"
        field = f" {self.field}:" if self.field else ""
        return f"{where}:{field} {self.message}"


class PolicyError(ValueError):
    """A policy that cannot be used. `problems` lists every error found, each with its location.

    `reason` says what kind of problem: "invalid" (the text was read, the policy fails
    validation), "unreadable" (the file cannot be opened), or the `ReadError` kind that stopped
    reading ("too_large", "encoding", "syntax", "depth", "aliases", "duplicate_key"); the API
    maps it to an HTTP status.
    """

    def __init__(self, problems: Sequence[Problem], reason: str = "invalid") -> None:
        self.problems = list(problems)
        self.reason = reason
        super().__init__("\n".join(str(p) for p in self.problems))


def field_path(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _locate(node: yaml.Node | None, loc: Sequence[str | int]) -> yaml.Mark | None:
    """The start mark of the deepest YAML node along `loc` (the key's mark for a missing field)."""
    mark = node.start_mark if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for key, value in node.value:
                if key.value == str(part):
                    # Point at the value for wrong values, but keep the key's mark as a fallback.
                    nxt, mark = value, value.start_mark
                    break
            if nxt is None:
                return mark
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            mark = node.start_mark
        else:
            return mark
    return mark


def clean_loc(loc: Sequence[Any]) -> list[str | int]:
    # pydantic inserts validator names (e.g. 'function-plain[_to_format()]') into locations.
    return [p for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))]


def _unknown_key_mark(node: yaml.Node | None, loc: Sequence[str | int]) -> yaml.Mark | None:
    """For an unknown key, point at the key itself, not its value."""
    if not loc:
        return None
    parent = node
    for part in loc[:-1]:
        if isinstance(parent, yaml.MappingNode):
            parent = next((v for k, v in parent.value if k.value == str(part)), None)
        elif isinstance(parent, yaml.SequenceNode) and isinstance(part, int) and part < len(parent.value):
            parent = parent.value[part]
        else:
            return None
    if isinstance(parent, yaml.MappingNode):
        for key, _ in parent.value:
            if key.value == str(loc[-1]):
                return key.start_mark
    return None


def _read_problem(exc: ReadError, source: str) -> PolicyError:
    return PolicyError([Problem(source, exc.line, exc.column, exc.path, exc.message)], reason=exc.kind)


def parse_policy(text: str | bytes, source: str = "<policy>") -> Policy:
    """Parse and validate policy text (YAML or JSON). Raises `PolicyError` with located problems.

    The text is read within `proxima.policy.reader`'s limits (size, UTF-8, nesting, alias
    expansion, duplicate keys) before anything else looks at it.
    """
    try:
        data, node = read_yaml(text)
    except ReadError as exc:
        raise _read_problem(exc, source) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError([Problem(source, 1, 1, "", "a policy must be a YAML mapping of keys to values")])
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            loc = clean_loc(err["loc"])
            mark = _unknown_key_mark(node, loc) if err["type"] == "extra_forbidden" else None
            mark = mark or _locate(node, loc)
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key (check the spelling; `proxima policy schema` lists valid keys)"
            elif msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            problems.append(
                Problem(
                    source,
                    mark.line + 1 if mark else None,
                    mark.column + 1 if mark else None,
                    field_path(loc),
                    msg,
                )
            )
        raise PolicyError(problems) from None


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file (never more than `MAX_POLICY_BYTES` of it).

    `path` may also name a shipped policy (`balanced`): a bare name that is not a file is looked up
    in `proxima.policies`, the package data every install carries."""
    p = Path(path)
    if not p.exists() and p.name == str(path) and not p.suffix and (POLICY_DIR / f"{p.name}.yaml").is_file():
        p = POLICY_DIR / f"{p.name}.yaml"
    try:
        data = read_bounded(p)
    except ReadError as exc:
        raise _read_problem(exc, str(p)) from None
    except OSError as exc:
        raise PolicyError(
            [Problem(str(p), None, None, "", f"cannot read policy file: {exc.strerror or exc}")], reason="unreadable"
        ) from None
    return parse_policy(data, source=str(p))


def dump_policy(policy: Policy) -> str:
    """The policy as YAML (formats written back as strings)."""
    return yaml.safe_dump(policy.model_dump(mode="json"), sort_keys=False)
