#!/usr/bin/env python3
"""What the plugin package's layout costs per pod: `cns-ipam` of this tree against a baseline rev.

The runtime starts one `python3 -IS` plugin process per pod operation, and every module the
plugin imports is a file to find, read and unmarshal on every one of them. So splitting
`cni_plugin/` into more modules has a price per pod; this script measures it, as a ratio against
the baseline measured in the same run:

- `import cni_plugin.ipam` (and `cni_plugin.cni`) in a fresh `python3 -IS`, baseline and current
  in turn: the CPU time (`time.process_time`, which a loaded machine distorts least) and wall time
  of the import alone, and the modules it loads;
- whole invocations, baseline and current in turn (A B A B ...), each a fresh process: its CPU
  time (user + system, from `wait4`) and wall time, for `VERSION` (start-up and import only), an
  ADD against a real daemon (idempotent: the same container every time, so every run is the same
  socket round trip), and a DEL with the daemon stopped (the release-queue write, a lazy import
  since the split).

Both packages are installed as `cns install-cni` installs them (copied, precompiled for
`/usr/bin/python3`, started by a `#!/usr/bin/python3 -IS` launcher). No root needed:

    .venv/bin/python -m bench.performance.plugin_modules --baseline 7eb1730 --runs 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.benchlib import REPO, BenchError, Daemon, export_revision, log, percentile

PLUGIN_PYTHON = "/usr/bin/python3"  # what `cns install-cni` writes into the launcher
EXTRA_MODULES = 5


def install(tree: Path, target: Path) -> Path:
    """`cns install-cni` of `tree`, run from `tree` (so each side is installed by its own code);
    returns the bin dir."""
    bin_dir = target / "bin"
    subprocess.run(
        [
            *(sys.executable, "-m", "cns.commands.cli", "install-cni", "--bin-dir", str(bin_dir)),
            *("--lib-dir", str(target / "lib"), "--python", PLUGIN_PYTHON),
        ],
        check=True,
        cwd=tree,
        capture_output=True,
    )
    return bin_dir


_IMPORT_PROBE = """\
import sys, time
sys.path.insert(0, {lib!r})
cpu, wall = time.process_time_ns(), time.perf_counter_ns()
import {module}
cpu, wall = time.process_time_ns() - cpu, time.perf_counter_ns() - wall
print(cpu, wall, ",".join(sorted(m for m in sys.modules if m.startswith("cni_plugin"))))
"""


def import_costs(
    libs: dict[str, Path], module: str, runs: int, modules: dict[str, str] | None = None
) -> dict[str, float | str]:
    """`import module` (or a side's `modules`) in a fresh `python3 -IS`, each side in turn: CPU and
    wall microseconds (medians; CPU time is what a loaded machine distorts least), the ratio, and
    the modules loaded."""
    cpu: dict[str, list[float]] = {name: [] for name in libs}
    wall: dict[str, list[float]] = {name: [] for name in libs}
    loaded: dict[str, str] = {}
    for _ in range(runs):
        for name, lib in libs.items():
            code = _IMPORT_PROBE.format(lib=str(lib), module=(modules or {}).get(name, module))
            out = subprocess.run(
                [PLUGIN_PYTHON, "-IS", "-c", code], capture_output=True, text=True, check=True
            ).stdout.split()
            cpu[name].append(int(out[0]) / 1000)
            wall[name].append(int(out[1]) / 1000)
            loaded[name] = out[2]
    figures: dict[str, float | str] = {}
    for name in libs:
        figures[f"{name} cpu us"] = statistics.median(cpu[name])
        figures[f"{name} wall us"] = statistics.median(wall[name])
        figures[f"{name} modules"] = loaded[name]
    figures["cpu ratio"] = statistics.median(cpu["current"]) / statistics.median(cpu["baseline"])
    log(f"import {module}: {figures}")
    return figures


def module_price(work: Path, runs: int) -> dict[str, float | str]:
    """What one more (small) module of the package costs: `import cni_plugin.ipam` against the
    same plus EXTRA_MODULES one-line modules in the package, each side in turn."""
    lib = work / "probe" / "lib"
    shutil.copytree(work / "current" / "lib", lib)
    for index in range(EXTRA_MODULES):
        (lib / "cni_plugin" / f"_probe{index}.py").write_text(f"VALUE = {index}\n")
    subprocess.run([PLUGIN_PYTHON, "-m", "compileall", "-q", str(lib)], check=True)
    extra = ", ".join(f"cni_plugin._probe{index}" for index in range(EXTRA_MODULES))
    figures = import_costs(
        {"baseline": lib, "current": lib},
        "cni_plugin.ipam",
        runs,
        modules={"current": f"cni_plugin.ipam, {extra}"},
    )
    extra_cpu = float(figures["current cpu us"]) - float(figures["baseline cpu us"])
    figures["cpu us per module"] = extra_cpu / EXTRA_MODULES
    log(f"one more module: {figures['cpu us per module']:.0f} us of CPU")
    return figures


def run_once(argv: list[str], env: dict[str, str], stdin: bytes) -> tuple[float, float]:
    """One whole process, fork to reap: (CPU seconds, user + system, as the kernel accounts
    them; wall seconds)."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(stdin)
    proc.stdin.close()
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise BenchError(f"{argv[0]} failed: {out[:300]!r} {err[:300]!r}")
    return usage.ru_utime + usage.ru_stime, wall


def paired(
    label: str, sides: dict[str, Path], env: dict[str, str], stdin: bytes, runs: int
) -> dict[str, float]:
    """Baseline and current in turn: medians (ms) of CPU and wall time, and the ratios."""
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    wall: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(5):  # warm-up: page cache, pyc files
        for plugin in sides.values():
            run_once([str(plugin)], env, stdin)
    for _ in range(runs):
        for name, plugin in sides.items():
            cpu_seconds, wall_seconds = run_once([str(plugin)], env, stdin)
            cpu[name].append(cpu_seconds)
            wall[name].append(wall_seconds)
    figures: dict[str, float] = {}
    for name in sides:
        figures[f"{name} cpu ms"] = 1000 * statistics.median(cpu[name])
        figures[f"{name} wall ms"] = 1000 * statistics.median(wall[name])
    for kind, times in (("cpu", cpu), ("wall", wall)):
        ratios = [c / b for b, c in zip(times["baseline"], times["current"], strict=True)]
        figures[f"{kind} ratio, median of pairs"] = statistics.median(ratios)
        figures[f"{kind} ratio p10"] = percentile(ratios, 10)
        figures[f"{kind} ratio p90"] = percentile(ratios, 90)
    log(f"{label}: {figures}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="git rev whose cni_plugin/ is compared")
    parser.add_argument("--runs", type=int, default=200, help="pairs per invocation kind")
    parser.add_argument("--import-runs", type=int, default=200, help="imports per side")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cns-plugin-modules-"))
    daemon = None
    try:
        baseline = work / "baseline-src"
        export_revision(args.baseline, baseline, "cns", "cni_plugin")
        trees = {"baseline": baseline, "current": REPO}
        bins = {name: install(tree, work / name) for name, tree in trees.items()}
        report: dict[str, object] = {"baseline": args.baseline, "runs": args.runs}
        libs = {name: work / name / "lib" for name in bins}
        for module in ("cni_plugin.ipam", "cni_plugin.cni"):
            report[f"import {module}"] = import_costs(libs, module, args.import_runs)
        report["one more module"] = module_price(work, args.import_runs)

        plugins = {name: bin_dir / "cns-ipam" for name, bin_dir in bins.items()}
        base_env = {"PATH": "/usr/bin:/bin", "CNI_PATH": "/opt/cni/bin", "CNI_IFNAME": "eth0"}
        report["VERSION"] = paired(
            "VERSION", plugins, {**base_env, "CNI_COMMAND": "VERSION"}, b"", args.runs
        )
        (work / "cns").mkdir()
        daemon = Daemon(work / "cns", {"standalone": {"allocationLatencyMs": 0}})
        daemon.start()
        config = {
            "cniVersion": "1.0.0",
            "name": "bench",
            "type": "bridge",
            "ipam": {
                "type": "cns-ipam",
                "socket": str(daemon.socket),
                "releaseQueueDir": str(work / "release-queue"),
            },
        }
        stdin = json.dumps(config).encode()
        add_env = {
            **base_env,
            "CNI_COMMAND": "ADD",
            "CNI_CONTAINERID": "bench-1",
            "CNI_NETNS": "/var/run/netns/bench",
        }
        report["ADD (idempotent)"] = paired("ADD", plugins, add_env, stdin, args.runs)
        daemon.stop()
        daemon = None
        del_env = {**add_env, "CNI_COMMAND": "DEL"}
        report["DEL, daemon down"] = paired("DEL", plugins, del_env, stdin, args.runs)
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        return 0
    except (BenchError, OSError, subprocess.CalledProcessError) as exc:
        print(f"plugin_modules: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
