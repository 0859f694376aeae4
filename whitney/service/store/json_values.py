"""Free JSON a client stores (user_metadata, a run sample's metadata, a loss config): how deep it may nest, checked at
the edge, and how a stored value is read back so that no row can break a read.

Objects and arrays inside one another are walked with an explicit stack, never by recursion, so no nesting
depth can exhaust Python's stack here. Depth counts containers: `{}` is 1, `{"a": [1]}` is 2.

Reading: JSON stored before these checks (or written to the database directly) may nest deeper than any
response can be serialised (pydantic's serialiser stops at 255 levels, json.loads at about 1,000). `loads`
(the store's JSON column reader) shows such a value down to MAX_DEPTH levels, each container below replaced by
TOO_DEEP, and a value that cannot be parsed at all as UNREADABLE: one odd row never turns a listing into a 500.
"""

from __future__ import annotations

import re
from typing import Any

from whitney.errors import InvalidInput
from whitney.service.http.text import loads as read_json

MAX_DEPTH = 32  # objects and arrays inside one another, in any stored free JSON field
TOO_DEEP = f"<nested deeper than {MAX_DEPTH} levels: not shown>"
UNREADABLE = {"unreadable": "this stored value could not be read back (nested too deep)"}

_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"')  # a JSON string, escapes included (its brackets are no nesting)
_NOT_BRACKET = re.compile(r"[^\[\]]++")
_SQUARE = str.maketrans("{}", "[]")


def depth_of(value: Any, stop: int | None = None) -> int:
    """How deep `value`'s objects and arrays nest (0 for a scalar); the walk ends once `stop` is passed."""
    deepest, stack = 0, [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if stop is not None and deepest > stop:
            break
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)) and child:
                stack.append((child, depth + 1))
            elif isinstance(child, (dict, list)):
                deepest = max(deepest, depth + 1)
    return deepest


def check_json(value: Any, field: str, max_depth: int = MAX_DEPTH) -> None:
    """A 400 naming `field` when `value` nests deeper than `max_depth`; before anything serialises it."""
    if depth_of(value, max_depth) > max_depth:
        raise InvalidInput(f"{field} nests objects and arrays more than {max_depth} levels deep; the limit is "
                           f"{max_depth}", field=field)


def text_depth_over(text: str, limit: int) -> bool:
    """Whether JSON `text` nests deeper than `limit`, read from its brackets alone (strings left out), in C-speed
    string operations: each pass removes the innermost pairs."""
    if text.count("[") + text.count("{") <= limit:  # nearly every row: too few brackets to nest that deep
        return False
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text).translate(_SQUARE))
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace("[]", "")
    return bool(brackets)


def loads(text: str | bytes) -> Any:
    """The store's JSON column reader: http.text.loads (lone surrogates as U+FFFD), with a value nesting deeper
    than MAX_DEPTH cut there (TOO_DEEP) and one that cannot be parsed at all read as UNREADABLE."""
    if isinstance(text, (bytes, bytearray)):
        text = text.decode("utf-8")
    try:
        value = read_json(text)
    except RecursionError:
        return dict(UNREADABLE)
    return _cut(value, MAX_DEPTH) if text_depth_over(text, MAX_DEPTH) else value


def _cut(value: Any, limit: int) -> Any:
    """`value` with every object or array below `limit` levels replaced by TOO_DEEP (in place; iterative)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        for key, child in list(node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(child, (dict, list)):
                if depth >= limit:
                    node[key] = TOO_DEEP
                else:
                    stack.append((child, depth + 1))
    return value
