"""The C library's heap in a long-lived process with large, growing tables: a fixed mmap
threshold.

The interpreter takes objects of up to 512 bytes from its own pools and everything larger (dict
and set tables, long strings, the JSON of every request, reply and watch event) from the C
library's `malloc`. glibc's `malloc` serves a block of 128 KiB or more with a mapping of its own,
given back to the system when freed, but each time the program frees such a block it raises
that threshold to the block's size, up to 32 MiB (mallopt(3), M_MMAP_THRESHOLD). The
controller's caches and planning state are tables of megabytes that grow by doubling while the
nodes are granted their addresses: once the first of them was freed, the next ones came from
the heap, and the space each left when it was resized was carved up by the small objects that
live on after it. At 5,000 nodes the leader's heap held 44 MiB free beside 80 MiB in use at its
memory peak (resident memory 290 MiB); with the threshold fixed at 64 KiB, 10 MiB free and
257 MiB resident, the same tables in mappings of their own (docs/benchmarks.md, "Controller
memory at 5,000 nodes").
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 64 * 1024


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve every block of `threshold` bytes or more with a mapping of its own, for good
    (`mallopt(M_MMAP_THRESHOLD, threshold)`, which also stops the threshold from rising; the
    environment variable MALLOC_MMAP_THRESHOLD_ sets the same at start-up). False, and nothing
    changes, where the C library has no `mallopt` (musl, macOS)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
