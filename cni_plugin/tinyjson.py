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

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

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


def _c_encode(obj: object) -> str:
    # A fresh markers dict per call: the C encoder may leave entries behind when it fails.
    encode = _json.make_encoder(
        {}, _unsupported, _json.encode_basestring_ascii, None, ":", ",", False, False, False
    )
    return "".join(encode(obj, 0))


def _stdlib_encode(obj: object) -> str:
    import json  # ~8 ms, paid only where the C encoder's private signature has changed

    return json.dumps(
        obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"), default=_unsupported
    )


# Not sorted, compact, ASCII, nested: what every setting passed to the C encoder above decides.
_PROBE = {"k": [1, -2.5, "\u00e9\n", None, True, {}], "a": 0}
_PROBE_TEXT = '{"k":[1,-2.5,"\\u00e9\\n",null,true,{}],"a":0}'
_PROBE_REFUSED = (float("nan"), {1j: 0})  # allow_nan and skipkeys must still be off


def _c_encoder_works() -> bool:
    try:
        if _c_encode(_PROBE) != _PROBE_TEXT:
            return False
    except Exception:
        return False
    for value in _PROBE_REFUSED:
        try:
            _c_encode(value)
        except (TypeError, ValueError):
            continue
        return False
    return True


def _choose_encoder() -> Callable[[object], str]:
    """The C encoder if ``_json.make_encoder`` still takes the arguments this module passes and
    still means by them what it did, else the stdlib ``json`` (the same output; ~8 ms more per
    run). ``make_encoder`` is private: CPython may change it in any release, and a plugin that
    failed every ADD after an interpreter upgrade would stop every pod on the node."""
    return _c_encode if _c_encoder_works() else _stdlib_encode


_encode = _choose_encoder()


def dumps(obj: object) -> str:
    """Serialise ``obj`` compactly (``,`` and ``:``) as ASCII; TypeError/ValueError if not JSON."""
    try:
        return _encode(obj)
    except RecursionError:
        raise ValueError("object nested too deeply (or circular)") from None
