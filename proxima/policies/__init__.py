"""The shipped policies (`off`, `conservative`, `balanced`, `aggressive`), installed with the package.

Every command that takes a policy takes a file or one of these names; `policy_path` is the one
place that turns a name into a file, so a plain `pip install` (not editable) finds them too.
"""

from __future__ import annotations

from pathlib import Path

POLICY_DIR = Path(__file__).resolve().parent
"""Where the shipped YAML files live (package data, see pyproject.toml)."""


def shipped_names() -> list[str]:
    """The names of the shipped policies, sorted."""
    return sorted(p.stem for p in POLICY_DIR.glob("*.yaml"))


def policy_path(policy: str | Path) -> Path:
    """`policy` as a file: an existing path as it is, else the shipped policy of that name.

    Raises `FileNotFoundError` naming the argument and the shipped names when it is neither."""
    path = Path(policy)
    if path.is_file():
        return path
    shipped = POLICY_DIR / f"{policy}.yaml"
    if shipped.is_file():
        return shipped
    raise FileNotFoundError(f"{str(policy)!r} is neither a file nor a shipped policy ({', '.join(shipped_names())})")


__all__ = ["POLICY_DIR", "policy_path", "shipped_names"]
