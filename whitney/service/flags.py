"""A setting `whitney serve` exposes as a flag: a dataclass field whose metadata holds the flag's help."""

from __future__ import annotations

from dataclasses import field


def flag(default: int, help: str):
    """A dataclass field of `default`, shown by `whitney serve --help` with `help`."""
    return field(default=default, metadata={"help": help})
