"""Find committed transactions in a SQLite write-ahead log that SQLite itself would drop.

SQLite replays the log frame by frame and stops at the first frame whose cumulative checksum
or salts do not match: it takes that frame for the torn end of the log. A damaged frame in the
middle (one flipped byte) therefore drops every later commit without a word, and the state file
would forget acknowledged assignments. This module reads the log the same way (the format is
SQLite's "file format" page, section "The Write-Ahead Log") and then looks past the first bad
frame: frames that carry the log's salts and whose checksums chain from the frame before them
were written in this generation of the log, so their commits are real.

With `synchronous=FULL` a transaction is acknowledged only after its fsync, and the next one is
written only then, so a crash can tear at most the transaction that was being written. The
transaction that holds the bad frame is that allowance; a commit after it is a lost one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

WAL_HEADER_BYTES = 32
FRAME_HEADER_BYTES = 24
_MAGIC_LITTLE = 0x377F0682
_MAGIC_BIG = 0x377F0683
_VERSION = 3007000
_MASK = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class LostCommits:
    """Where the log is damaged and how many committed transactions after it SQLite would drop."""

    frame: int  # 1-based, as SQLite numbers frames; 0 for the log's header
    offset: int  # byte offset of that frame (or of the header) in the log
    commits: int

    def describe(self) -> str:
        where = (
            "its header is invalid"
            if self.frame == 0
            else f"frame {self.frame} (byte offset {self.offset}) breaks its checksum chain"
        )
        return (
            f"{where}, and {self.commits} committed transaction(s) after it would be dropped "
            "by SQLite without a word"
        )


@dataclass(frozen=True, slots=True)
class _Header:
    big_endian: bool
    page_size: int
    salts: bytes
    checksum: tuple[int, int]
    valid: bool


def checksum(data: bytes, start: tuple[int, int], *, big_endian: bool) -> tuple[int, int]:
    """SQLite's WAL checksum of `data` (a multiple of 8 bytes), continuing from `start`."""
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    s0, s1 = start
    pairs = iter(words)
    for first, second in zip(pairs, pairs, strict=True):
        s0 = (s0 + first + s1) & _MASK
        s1 = (s1 + second + s0) & _MASK
    return s0, s1


def _page_size_valid(size: int) -> bool:
    return 512 <= size <= 65536 and size & (size - 1) == 0


def _header(data: bytes, fallback_page_size: int) -> _Header:
    magic, version, page_size, _, _, _, sum0, sum1 = struct.unpack(">8I", data[:32])
    big_endian = magic == _MAGIC_BIG
    valid = (
        magic in (_MAGIC_LITTLE, _MAGIC_BIG)
        and version == _VERSION
        and _page_size_valid(page_size)
        and checksum(data[:24], (0, 0), big_endian=big_endian) == (sum0, sum1)
    )
    return _Header(
        big_endian=big_endian,
        page_size=page_size if _page_size_valid(page_size) else fallback_page_size,
        salts=data[16:24],
        checksum=(sum0, sum1),
        valid=valid,
    )


def lost_commits(data: bytes, fallback_page_size: int) -> LostCommits | None:
    """Committed transactions in the log `data` that SQLite would not replay, or None.

    `fallback_page_size` (the database's) frames the log when its header is damaged. A log
    shorter than its header, all zeros, or ending in the torn frames of one unfinished
    transaction loses nothing.
    """
    if len(data) < WAL_HEADER_BYTES:
        return None
    header = _header(data, fallback_page_size)
    frame_bytes = FRAME_HEADER_BYTES + header.page_size
    count = (len(data) - WAL_HEADER_BYTES) // frame_bytes

    def frame(index: int) -> tuple[int, int, bytes, tuple[int, int], bytes]:
        offset = WAL_HEADER_BYTES + index * frame_bytes
        head = data[offset : offset + FRAME_HEADER_BYTES]
        page_number, commit, sum0, sum1 = struct.unpack(">II8xII", head)
        body = head[:8] + data[offset + FRAME_HEADER_BYTES : offset + frame_bytes]
        return page_number, commit, head[8:16], (sum0, sum1), body

    def chains(index: int, previous: tuple[int, int], salts: bytes) -> bool:
        page_number, _, frame_salts, stored, body = frame(index)
        return (
            page_number != 0
            and frame_salts == salts
            and checksum(body, previous, big_endian=header.big_endian) == stored
        )

    # What SQLite replays: every frame up to the first one that breaks the chain.
    first_bad = 0
    if header.valid:
        previous = header.checksum
        while first_bad < count and chains(first_bad, previous, header.salts):
            previous = frame(first_bad)[3]
            first_bad += 1
        if first_bad == count:
            return None
    if count == 0:
        return None
    salts = header.salts if header.valid else frame(0)[2]
    # The transaction that holds the bad frame may be the torn one: it ends at the first frame
    # from there on that says it commits. A commit after that, in a frame of this generation
    # (the log's salts) whose checksum chains from the frame before it, is a lost one.
    first_commit = next((i for i in range(first_bad, count) if frame(i)[1] != 0), count)
    lost = sum(
        1
        for index in range(first_commit + 1, count)
        if frame(index)[1] != 0 and chains(index, frame(index - 1)[3], salts)
    )
    if lost <= 0:
        return None
    if not header.valid:
        return LostCommits(frame=0, offset=0, commits=lost)
    return LostCommits(
        frame=first_bad + 1,
        offset=WAL_HEADER_BYTES + first_bad * frame_bytes,
        commits=lost,
    )


def database_page_size(path: Path) -> int:
    """The page size a SQLite database file's header records (4096 when unreadable)."""
    try:
        with path.open("rb") as file:
            head = file.read(18)
    except OSError:
        return 4096
    if len(head) < 18:
        return 4096
    size = struct.unpack(">H", head[16:18])[0]
    size = 65536 if size == 1 else size
    return size if _page_size_valid(size) else 4096
