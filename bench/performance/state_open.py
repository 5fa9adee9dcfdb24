"""What the state file's start-up checks cost: `Store.open` with them and without, same run.

Issue 25 replaced `PRAGMA quick_check` (which does not compare indexes with tables) by
`PRAGMA integrity_check`, and added a scan that refuses two rows of one address, IP id or owner,
and a check of the write-ahead log before SQLite replays it. This opens one crash image (the
state file and its log as kill -9 leaves them, ROWS assignments) again and again, in turns:

- `checked`: `Store.open` as it is;
- `quick`: as before issue 25: quick_check only, no duplicate scan, no log check;
- `unchecked`: no integrity check, no duplicate scan, no log check (the floor).

    .venv/bin/python -m bench.performance.state_open --rows 250 30000 --rounds 9

Prints one JSON object on stdout (and a table on stderr): the median open time of each variant
and the ratios checked/quick and checked/unchecked, per row count.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cns.state.store
from cns.core.pool import Assignment
from cns.core.types import Owner
from cns.state.store import Save, Store

BATCH = 500


def quick_check(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA quick_check").fetchone()


VARIANTS: dict[str, dict[str, Callable[..., Any]]] = {
    "checked": {},
    "quick": {
        "_check_integrity": quick_check,
        "_read_checked": cns.state.store._read,
        "lost_commits": lambda data, page_size: None,
    },
    "unchecked": {
        "_check_integrity": lambda db: None,
        "_read_checked": cns.state.store._read,
        "lost_commits": lambda data, page_size: None,
    },
}


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    saved = {attr: getattr(cns.state.store, attr) for attr in VARIANTS[name]}
    for attr, replacement in VARIANTS[name].items():
        setattr(cns.state.store, attr, replacement)
    try:
        yield
    finally:
        for attr, original in saved.items():
            setattr(cns.state.store, attr, original)


async def fill(path: Path, rows: int, image: Path) -> None:
    """`rows` assignments in batches, then a copy of the files as a crash would leave them."""
    store = Store(path)
    store.open()
    for start in range(0, rows, BATCH):
        ops = [
            Save(
                Assignment(
                    f"ip-{n}",
                    f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}",
                    "nc",
                    Owner(f"container-{n:08d}", "eth0", f"pod-{n}", "default"),
                )
            )
            for n in range(start, min(rows, start + BATCH))
        ]
        await store.commit(ops)
    image.mkdir()
    for suffix in ("", "-wal"):
        shutil.copyfile(f"{path}{suffix}", image / f"state.db{suffix}")
    store.close()


def open_once(image: Path, scratch: Path, name: str) -> float:
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(image, scratch)
    store = Store(scratch / "state.db")
    with variant(name):
        started = time.perf_counter()
        store.open()
        elapsed = time.perf_counter() - started
    store.close()
    return elapsed


def measure(rows: int, rounds: int, parent: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"state-open-{rows}-", dir=parent))
    try:
        asyncio.run(fill(work / "live.db", rows, work / "image"))
        wal_bytes = (work / "image" / "state.db-wal").stat().st_size
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(rounds):
            for name in VARIANTS:  # in turns, so drift hits every variant alike
                times[name].append(open_once(work / "image", work / "scratch", name))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        "rows": rows,
        "wal_bytes": wal_bytes,
        "median_ms": {name: round(value * 1000, 2) for name, value in median.items()},
        "checked_over_quick": round(median["checked"] / median["quick"], 2),
        "checked_over_unchecked": round(median["checked"] / median["unchecked"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[250, 30000])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dir", default="/var/tmp", help="where the scratch state files go")
    args = parser.parse_args()
    results = [measure(rows, args.rounds, Path(args.dir)) for rows in args.rows]
    for result in results:
        ms = result["median_ms"]
        print(
            f"{result['rows']:>6} rows (log {result['wal_bytes']:>8} B): checked "
            f"{ms['checked']:8.2f} ms, quick {ms['quick']:8.2f} ms, unchecked "
            f"{ms['unchecked']:8.2f} ms; checked/quick {result['checked_over_quick']}x, "
            f"checked/unchecked {result['checked_over_unchecked']}x",
            file=sys.stderr,
        )
    print(json.dumps({"rounds": args.rounds, "results": results}, indent=1))


if __name__ == "__main__":
    main()
