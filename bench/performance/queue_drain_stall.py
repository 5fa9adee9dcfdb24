"""How long a release-queue drain of many bad files stalls the daemon's event loop.

A `cns run` daemon of this checkout and one of `--baseline` (its `cns` and `cni_plugin`
exported with `git archive`, run with `PYTHONPATH` pointing at them) take turns: each round
moves a directory of `--files` invalid queue files into place, sends SIGHUP, and meanwhile a
probe thread asks the debug endpoint's `/healthz` (answered on the event loop) back to back.
The longest answer while the drain runs is the longest stall; the log lines the drain wrote are
counted. Reports both per round and the ratio baseline/this of the longest stall.

    python -m bench.performance.queue_drain_stall --files 50000 --rounds 3 --baseline main
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.benchlib import REPO, Daemon, durable_temp_parent, export_revision, log


def probe(url: str, stop: threading.Event, latencies: list[float]) -> None:
    """Ask `url` back to back until `stop`; each answer's latency in seconds."""
    while not stop.is_set():
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=60) as response:
            response.read()
        latencies.append(time.perf_counter() - started)


def one_round(workdir: Path, code: Path | None, files: int) -> dict[str, float]:
    """A daemon (of `code`, or this checkout), a drain of `files` bad files: the longest and
    median answer of the probe while it ran, the idle longest before it, and the log lines."""
    saved = os.environ.get("PYTHONPATH")
    if code is not None:
        os.environ["PYTHONPATH"] = str(code)
    try:
        # -P: the module search path starts at PYTHONPATH, not at the daemon's cwd (this repo).
        daemon = Daemon(workdir, {"logFormat": "json"}, wrap=["-P"])
        daemon.start()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        staging = daemon.state_dir / "staging"
        staging.mkdir()
        for n in range(files):
            (staging / f"bad{n}_eth0.json").write_bytes(b"{")
        queue = daemon.state_dir / "release-queue"
        url = f"{daemon.debug_url}/healthz"
        idle: list[float] = []
        stop = threading.Event()
        idle_probe = threading.Thread(target=probe, args=(url, stop, idle))
        idle_probe.start()
        time.sleep(1.0)
        stop.set()
        idle_probe.join()
        latencies: list[float] = []
        stop = threading.Event()
        prober = threading.Thread(target=probe, args=(url, stop, latencies))
        prober.start()
        started = time.perf_counter()
        if queue.exists():
            queue.rmdir()
        staging.rename(queue)
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        while any(name != "quarantine" for name in os.listdir(queue)):
            time.sleep(0.05)
        time.sleep(0.5)  # the drain's last log lines, after the last file
        stop.set()
        prober.join()
        drained = time.perf_counter() - started
        lines = [
            line
            for line in daemon.log().splitlines()
            if '"release_queue_entr' in line and "invalid" in line
        ]
        return {
            "longestStallSeconds": max(latencies),
            "medianAnswerSeconds": sorted(latencies)[len(latencies) // 2],
            "idleLongestSeconds": max(idle),
            "drainSeconds": drained,
            "logLines": len(lines),
            "answers": len(latencies),
        }
    finally:
        daemon.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", default="main", help="git revision to compare with")
    parser.add_argument("--tmp-dir", help="where the daemons' directories go (on disk)")
    args = parser.parse_args()
    parent = durable_temp_parent(args.tmp_dir)
    results: dict[str, list[dict[str, float]]] = {"baseline": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="cns-qstall-", dir=parent) as tmp:
        baseline_code = Path(tmp) / "baseline"
        commit = export_revision(args.baseline, baseline_code, "cns", "cni_plugin")
        for n in range(args.rounds):
            for name, code in (("baseline", baseline_code), ("this", None)):
                workdir = Path(tmp) / f"{name}{n}"
                workdir.mkdir()
                log(f"round {n + 1}/{args.rounds}: {name}")
                results[name].append(one_round(workdir, code, args.files))
    worst = {name: max(r["longestStallSeconds"] for r in runs) for name, runs in results.items()}
    report = {
        "files": args.files,
        "baseline": f"{args.baseline} ({commit[:12]})",
        "code": str(REPO),
        "rounds": results,
        "longestStallRatioBaselineToThis": worst["baseline"] / worst["this"],
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
