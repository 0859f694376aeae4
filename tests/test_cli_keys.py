"""`whitney keys` as a user runs it, and where `whitney serve` takes its per-key limits from."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from whitney import cli
from whitney.service.store.key_limits import KeyLimits, parse_limit


def serve_limits(*argv: str):
    parser_args = argparse.ArgumentParser()
    cli.add_key_limit_flags(parser_args)
    return cli.key_limits(parser_args.parse_args(list(argv)))


def test_limits_come_from_defaults_then_the_file_then_the_flags(tmp_path):
    assert serve_limits() == KeyLimits()
    assert KeyLimits().max_sessions and KeyLimits().max_runs and KeyLimits().max_queued_operations
    assert KeyLimits().max_adapter_bytes == 0 and KeyLimits().max_tokens_per_minute == 0  # the machine's to size
    limits = tmp_path / "limits.toml"
    limits.write_text('max_runs = 16\nmax_adapter_bytes = "8GiB"\nmax_tokens_per_minute = 100000\n')
    got = serve_limits("--limits-file", str(limits), "--max-runs-per-key", "4", "--max-sessions-per-key", "0")
    assert got == KeyLimits(max_sessions=0, max_runs=4, max_adapter_bytes=8 * 2**30, max_tokens_per_minute=100_000)
    limits.write_text("max_rums = 3\n")
    with pytest.raises(ValueError, match="max_rums"):
        serve_limits("--limits-file", str(limits))


@pytest.mark.parametrize("value,expected", [("12", 12), (7, 7), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30),
                                            ("1 kib", 1024)])
def test_byte_limits_take_units(value, expected):
    assert parse_limit("max_adapter_bytes", value) == expected


@pytest.mark.parametrize("name,value", [("max_runs", "2GiB"), ("max_runs", -1), ("max_runs", True),
                                        ("max_adapter_bytes", "lots"), ("max_runs", 1.5)])
def test_bad_limits_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        parse_limit(name, value)


def test_keys_create_list_revoke_as_a_command(tmp_path):
    """The real command in a subprocess: the key goes to stdout once; list and revoke never show it."""
    def whitney(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "whitney.cli", "keys", *args, "--data-dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)

    made = whitney("create", "--name", "alice", "--max-runs", "3", "--max-adapter-bytes", "1GiB")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("tml-wk-") and "shown only now" in made.stderr
    (row,) = json.loads(whitney("list", "--json").stdout)
    assert row["name"] == "alice" and row["max_runs"] == 3 and row["max_adapter_bytes"] == 2**30
    assert row["max_sessions"] is None and row["revoked_at"] is None  # unset: the server's default
    table = whitney("list").stdout
    assert "alice" in table and "max_runs=3" in table and key not in table
    assert whitney("revoke", row["id"]).returncode == 0
    assert json.loads(whitney("list", "--json").stdout)[0]["revoked_at"] is not None
    missing = whitney("revoke", "key-nope")
    assert missing.returncode == 1 and "key-nope" in missing.stderr
    assert key.encode() not in (tmp_path / "whitney.db").read_bytes()
