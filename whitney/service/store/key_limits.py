"""Per-key limits (quotas) and how a flag, a file or `whitney keys create` spells them. Light on imports: the
`whitney` command builds its help from these without loading the store."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace


@dataclass(frozen=True)
class KeyLimits:
    """Per-key limits; 0 is unlimited. The defaults here are the server's unless flags or a file say otherwise.

    Only limits that no ordinary use reaches have a default: the memory and tokens a machine can afford
    are the operator's to set.
    """

    max_sessions: int = field(default=1_000, metadata={
        "help": "active sessions (closed and expired ones do not count)"})
    max_runs: int = field(default=256, metadata={
        "help": "live runs (finished, cancelled, failed and interrupted ones do not count)"})
    max_adapter_bytes: int = field(default=0, metadata={
        "help": "memory of the live runs: LoRA weights, AdamW moments and gradients (units: 8GiB, 500MB)"})
    max_queued_operations: int = field(default=4_096, metadata={
        "help": "operations queued or running, training and sampling"})
    max_tokens_per_minute: int = field(default=0, metadata={
        "help": "forward and forward_backward tokens submitted in the last 60 s"})
    max_refusals_per_minute: int = field(default=120, metadata={
        "help": "requests refused for what they hold (400, 413, 415, 422; one more per MiB of body) per minute: "
                "beyond it the key's requests wait for the budget (http/refusals.py)"})

    def override(self, own: dict) -> "KeyLimits":
        """These limits, with each of a key's own (not None) in their place."""
        return replace(self, **{k: v for k, v in own.items() if k in LIMITS and v is not None})


LIMITS = tuple(f.name for f in fields(KeyLimits))
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_limit(name: str, value: object) -> int:
    """A limit from a flag or a file: a non-negative integer; byte limits may carry a unit ("8GiB", "500MB")."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]i?)?b?\s*", str(value).lower()) if isinstance(value, str) else None
    if match is None or (match.group(2) and name != "max_adapter_bytes"):
        unit = " (units: KB, MB, GB, KiB, MiB, GiB)" if name == "max_adapter_bytes" else ""
        raise ValueError(f"{name} must be a non-negative integer{unit}, got {value!r}")
    return int(match.group(1)) * _UNITS[match.group(2) or ""]


def limits_from_file(path: str) -> dict[str, int]:
    """Per-key default limits from a TOML file of top-level `max_... = N` lines (docs/API.md); unknown names raise."""
    import tomllib

    with open(path, "rb") as f:
        table = tomllib.load(f)
    unknown = sorted(set(table) - set(LIMITS))
    if unknown:
        raise ValueError(f"{path}: unknown limits {unknown}; known: {list(LIMITS)}")
    return {name: parse_limit(name, value) for name, value in table.items()}
