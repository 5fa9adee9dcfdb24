"""cns.host.heap: the mmap threshold stays where it is set, checked in a fresh interpreter with
glibc's own count of the bytes it has in mappings (`mallinfo2`)."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from tests.harness import REPO

# A 4 MiB block is mapped, then freed (glibc's default then raises its threshold to 4 MiB);
# then how many bytes a 512 KiB block adds to the mapped ones.
MAPPED = """
import ctypes, sys


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost",
    )]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
if sys.argv[1] == "fixed":
    from cns.host.heap import fix_mmap_threshold
    assert fix_mmap_threshold()
libc.free(libc.malloc(4 << 20))
before = libc.mallinfo2().hblkhd
block = libc.malloc(512 << 10)
print(libc.mallinfo2().hblkhd - before)
libc.free(block)
"""

glibc = pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc's mallinfo2 is not there"
)


def mapped(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", MAPPED, mode],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return int(done.stdout)


@glibc
def test_a_large_block_is_mapped_after_a_larger_one_was_freed() -> None:
    assert mapped("fixed") >= 512 << 10


@glibc
def test_without_it_the_threshold_rises_and_the_block_comes_from_the_heap() -> None:
    """The check above can fail: glibc's default is what `fix_mmap_threshold` changes."""
    assert mapped("default") == 0


def test_nothing_changes_where_the_c_library_has_no_mallopt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cns.host import heap

    monkeypatch.setattr(ctypes, "CDLL", lambda _name: object())
    assert heap.fix_mmap_threshold() is False
