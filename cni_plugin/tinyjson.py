"""A JSON codec built directly on the C accelerator module ``_json``.

Why not ``import json``: the container runtime starts one plugin process per pod operation
(``python3 -I -S``), so start-up time is paid on every pod. ``import json`` costs ~8 ms because
it imports ``re`` for its pure-Python fallback scanner; ``_json`` is the very same C parser and
encoder that ``json`` uses and imports in ~0.3 ms. Output is compact and ASCII-only, which also
makes it independent of the locale's stdout encoding.

NaN and +-Infinity are rejected both ways: they are not JSON and the CNI runtime (Go) refuses them.
"""

from __future__ import annotations

import _json

__all__ = ["dumps", "loads"]

_WS = " \t\n\r"  # the only whitespace JSON allows


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


class _Context:
    """The attributes ``_json.make_scanner`` reads from its context (normally a JSONDecoder)."""

    __slots__ = (
        "memo",
        "object_hook",
        "object_pairs_hook",
        "parse_constant",
        "parse_float",
        "parse_int",
        "strict",
    )

    def __init__(self) -> None:
        self.strict = True  # no raw control characters inside strings
        self.object_hook = None
        self.object_pairs_hook = None
        self.parse_float = float  # the exact types select the C fast paths
        self.parse_int = int
        self.parse_constant = _reject_constant
        self.memo: dict[str, str] = {}


_scan = _json.make_scanner(_Context())  # type: ignore[arg-type]


def _describe(text: str) -> str:
    """Explain why ``text`` is not JSON, via the stdlib (error path only).

    On 3.11 the C scanner can only raise its ValueError subclass when ``json.decoder`` is already
    imported; otherwise it fails with a bare SystemError. Paying the ~8 ms import here, on
    malformed input only, gets the stdlib's message with line, column and position.
    """
    import json  # deliberately lazy, see above

    try:
        json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        return str(exc)
    return "invalid JSON"


def loads(text: str) -> object:
    """Parse one JSON document; raise ValueError (with the position) on anything else."""
    start = len(text) - len(text.lstrip(_WS))
    try:
        obj, end = _scan(text, start)
    except StopIteration as exc:
        raise ValueError(f"Expecting value: char {exc.value}") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except ValueError:
        raise  # already carries a position (or is our NaN/Infinity rejection)
    except Exception:
        raise ValueError(_describe(text)) from None
    rest = text[end:]
    if rest.strip(_WS):
        raise ValueError(f"Extra data: char {end + len(rest) - len(rest.lstrip(_WS))}")
    return obj


def _unsupported(obj: object) -> object:
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def dumps(obj: object) -> str:
    """Serialise ``obj`` compactly (``,`` and ``:``) as ASCII; TypeError/ValueError if not JSON."""
    # A fresh markers dict per call: the C encoder may leave entries behind when it fails.
    encode = _json.make_encoder(
        {}, _unsupported, _json.encode_basestring_ascii, None, ":", ",", False, False, False
    )
    try:
        return "".join(encode(obj, 0))
    except RecursionError:
        raise ValueError("object nested too deeply (or circular)") from None
