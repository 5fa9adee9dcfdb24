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


def _header(data: bytes) -> _Header:
    magic, version, page_size, _, _, _, sum0, sum1 = struct.unpack(">8I", data[:32])
    big_endian = magic == _MAGIC_BIG
    valid = (
        magic in (_MAGIC_LITTLE, _MAGIC_BIG)
        and version == _VERSION
        and _page_size_valid(page_size)
        and checksum(data[:24], (0, 0), big_endian=big_endian) == (sum0, sum1)
    )
    return _Header(big_endian, page_size, data[16:24], (sum0, sum1), valid)


class _Frames:
    """The log's frames, for one page size and checksum byte order."""

    def __init__(self, data: bytes, page_size: int, *, big_endian: bool) -> None:
        self.data = data
        self.size = FRAME_HEADER_BYTES + page_size
        self.count = (len(data) - WAL_HEADER_BYTES) // self.size
        self.big_endian = big_endian

    def offset(self, index: int) -> int:
        return WAL_HEADER_BYTES + index * self.size

    def commit(self, index: int) -> int:
        """The frame's commit field: the database's size in pages after a commit, else 0."""
        offset = self.offset(index) + 4
        return int.from_bytes(self.data[offset : offset + 4], "big")

    def stored_checksum(self, index: int) -> tuple[int, int]:
        offset = self.offset(index) + 16
        sum0, sum1 = struct.unpack(">II", self.data[offset : offset + 8])
        return sum0, sum1

    def salts(self, index: int) -> bytes:
        offset = self.offset(index) + 8
        return self.data[offset : offset + 8]

    def chains(self, index: int, previous: tuple[int, int], salts: bytes) -> bool:
        """SQLite's test of a frame: a page number, the log's salts, and the checksum of its
        header's first 8 bytes and its page, continued from `previous`, as stored."""
        offset = self.offset(index)
        head = self.data[offset : offset + 8]
        page = self.data[offset + FRAME_HEADER_BYTES : offset + self.size]
        return (
            head[:4] != bytes(4)
            and self.salts(index) == salts
            and checksum(head + page, previous, big_endian=self.big_endian)
            == self.stored_checksum(index)
        )

    def replayed(self, header: _Header) -> int:
        """How many frames SQLite replays: those before the first that breaks the chain."""
        previous = header.checksum
        for index in range(self.count):
            if not self.chains(index, previous, header.salts):
                return index
            previous = self.stored_checksum(index)
        return self.count

    def commits_after(self, first_bad: int, salts: bytes) -> int:
        """Commits SQLite drops beyond the transaction that holds frame `first_bad`.

        That transaction may be the torn one: it ends at the first frame from there on that
        says it commits. A commit after that, in a frame of this generation (the log's salts)
        whose checksum chains from the stored checksum of the frame before it, is a lost one.
        """
        first_commit = next(
            (i for i in range(first_bad, self.count) if self.commit(i) != 0), self.count
        )
        return sum(
            1
            for index in range(first_commit + 1, self.count)
            if self.commit(index) != 0
            and self.chains(index, self.stored_checksum(index - 1), salts)
        )


def lost_commits(data: bytes, db_page_size: int) -> LostCommits | None:
    """Committed transactions in the log `data` that SQLite would not replay, or None.

    A log shorter than its header, all zeros, or ending in the torn frames of one unfinished
    transaction loses nothing. A damaged header makes SQLite ignore the whole log: its frames
    are then read with the database's page size (`db_page_size`), in either byte order.
    """
    if len(data) < WAL_HEADER_BYTES:
        return None
    header = _header(data)
    if header.valid:
        frames = _Frames(data, header.page_size, big_endian=header.big_endian)
        first_bad = frames.replayed(header)
        if first_bad == frames.count:
            return None
        lost = frames.commits_after(first_bad, header.salts)
        return LostCommits(first_bad + 1, frames.offset(first_bad), lost) if lost else None
    lost = 0
    for big_endian in (False, True):
        frames = _Frames(data, db_page_size, big_endian=big_endian)
        if frames.count:
            lost = max(lost, frames.commits_after(0, frames.salts(0)))
    return LostCommits(0, 0, lost) if lost else None


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
