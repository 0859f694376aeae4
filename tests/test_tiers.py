"""The quick tier's table (tests/conftest.py, docs/TESTING.md): every entry names a directory, module or test
that exists, so that a rename cannot put a heavy test back into `make test-quick` unnoticed."""

from __future__ import annotations

import ast

from tests.conftest import HEAVY, TESTS


def test_every_heavy_entry_names_what_exists():
    for entry in HEAVY:
        path, _, name = entry.partition("::")
        assert (TESTS / path).exists(), f"{entry}: no such directory or module under tests/"
        if name:
            tree = ast.parse((TESTS / path).read_text())
            assert name in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}, entry
