#!/usr/bin/env python3
"""One pod ADD through the reference `bridge` plugin: `host-local` versus `cns-ipam` IPAM.

Why this shape:
- Both chains are measured in ONE hyperfine invocation, so they share the machine's state
  (load, caches, CPU frequency) and the comparison is fair; each has its own bridge, subnet and
  network namespace so they cannot disturb each other.
- Every timed run is a real ADD in a fresh state: hyperfine's per-command `--prepare` runs a DEL
  through the same chain first (idempotent, so the very first one is a no-op), which removes the
  veth and releases the IP. The measured ADD therefore creates the veth pair, gets an IP from
  IPAM (host-local: a file in its own dataDir; cns-ipam: a Python process, a unix-socket
  round trip and a durable SQLite commit in the daemon) and configures the namespace.
- The start-up cost of the plugin itself (a fresh `python3 -IS` per invocation) is measured on
  its own: `cns-ipam` answering VERSION versus a bare `python3 -IS -c pass` (and `host-local`
  VERSION for reference), plus `-X importtime` of the plugin's import.
- The daemon's own view (`cns_cni_request_duration_seconds` for ADD) is read before and after,
  which splits the cns-ipam ADD into daemon time and everything else.

Run as root: `.venv/bin/python -m bench.performance.plugin_add` (needs hyperfine, iproute2 and the
reference CNI plugins in /usr/lib/cni). Everything it creates (namespaces, bridges, daemon,
temp dirs) is removed at exit; the hyperfine exports are kept in the printed results dir.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.benchlib import (
    BenchError,
    Daemon,
    exit_cleanly_on_sigterm,
    install_cni,
    log,
    machine_facts,
    metric_sum,
    percentile,
    plugin_daemon,
    print_facts,
    temp_work_dir,
)

REFERENCE_PLUGINS = Path("/usr/lib/cni")
PLUGIN_PYTHON = "/usr/bin/python3"  # what `cns install-cni` puts in the launcher's shebang
TARGET_RATIO = 2.0
ADD_METRIC = 'cns_cni_request_duration_seconds_{}{{result="ok",verb="add"}}'


@dataclass
class Side:
    """One plugin chain: its bridge, namespace, network config and CNI environment."""

    label: str
    bridge: str
    netns: str
    container_id: str
    cni_path: str
    config: dict[str, Any]
    config_file: Path

    def env(self, command: str, container_id: str = "") -> dict[str, str]:
        return {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": container_id or self.container_id,
            "CNI_NETNS": f"/var/run/netns/{self.netns}",
            "CNI_IFNAME": "eth0",
            "CNI_PATH": self.cni_path,
            "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAME=bench-pod;K8S_POD_NAMESPACE=bench",
        }

    def shell(self, command: str, binary: Path | None = None, container_id: str = "") -> str:
        """The command line hyperfine runs (through sh, for the stdin redirection).

        `binary` defaults to the bridge plugin; an IPAM plugin gets the same network config.
        """
        env = self.env(command, container_id)
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        program = shlex.quote(str(binary or REFERENCE_PLUGINS / "bridge"))
        return f"{assignments} {program} < {shlex.quote(str(self.config_file))}"

    def run(self, command: str) -> subprocess.CompletedProcess[str]:
        """One invocation outside hyperfine, to check that the chain works at all."""
        return subprocess.run(
            [str(REFERENCE_PLUGINS / "bridge")],
            input=self.config_file.read_text(),
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **self.env(command)},
            capture_output=True,
            text=True,
            timeout=60,
        )


def stats(times: list[float]) -> dict[str, float]:
    """Milliseconds: mean, median, p95 (from hyperfine's per-run `times`), stddev, min, max."""
    n = len(times)
    mean = sum(times) / n
    stddev = (sum((t - mean) ** 2 for t in times) / (n - 1)) ** 0.5 if n > 1 else 0.0
    ms = 1000.0
    return {
        "runs": n,
        "mean": mean * ms,
        "median": percentile(times, 50) * ms,
        "p95": percentile(times, 95) * ms,
        "stddev": stddev * ms,
        "min": min(times) * ms,
        "max": max(times) * ms,
    }


def hyperfine(
    commands: list[tuple[str, str]],
    out: Path,
    name: str,
    runs: int,
    warmup: int,
    extra: list[str],
    env: dict[str, str] | None = None,
) -> dict[str, dict[str, float]]:
    """Run hyperfine once for all `commands` (name, command line); export JSON and markdown."""
    json_path = out / f"{name}.json"
    markdown_path = out / f"{name}.md"
    argv = [
        "hyperfine",
        "--warmup",
        str(warmup),
        "--runs",
        str(runs),
        "--export-json",
        str(json_path),
        "--export-markdown",
        str(markdown_path),
        "--style",
        "basic",
        *extra,
    ]
    for command_name, _ in commands:
        argv += ["--command-name", command_name]
    argv += [command for _, command in commands]
    log(f"hyperfine {name}: {len(commands)} commands x {runs} runs (+{warmup} warm-up)")
    (out / f"{name}.cmd").write_text(shlex.join(argv) + "\n")
    result = subprocess.run(argv, env=env, stdout=sys.stderr)
    if result.returncode != 0:
        raise BenchError(f"hyperfine {name} failed (exit {result.returncode})")
    data = json.loads(json_path.read_text())
    return {r["command"]: stats(r["times"]) for r in data["results"]}


def print_stats(title: str, results: dict[str, dict[str, float]]) -> None:
    print(title)
    header = (
        f"  {'command':<36}{'runs':>5}{'mean':>9}{'median':>9}{'p95':>9}"
        f"{'stddev':>9}{'min':>9}{'max':>9}"
    )
    print(header)
    for command, s in results.items():
        print(
            f"  {command:<36}{s['runs']:>5}{s['mean']:>7.2f}ms{s['median']:>7.2f}ms"
            f"{s['p95']:>7.2f}ms{s['stddev']:>7.2f}ms{s['min']:>7.2f}ms{s['max']:>7.2f}ms"
        )


def import_times(lib_dir: Path, repeats: int) -> list[tuple[str, float, float]]:
    """Median self/cumulative microseconds per module of `-X importtime` of the plugin import.

    Single importtime runs are noisy at this scale (hundreds of microseconds), hence repeats.
    """
    code = f"import sys; sys.path.insert(0, {str(lib_dir)!r}); import cni_plugin.ipam"
    order: list[str] = []
    samples: dict[str, list[tuple[float, float]]] = {}
    for _ in range(repeats):
        result = subprocess.run(
            [PLUGIN_PYTHON, "-IS", "-X", "importtime", "-c", code],
            capture_output=True,
            text=True,
            check=True,
        )
        for line in result.stderr.splitlines():
            if not line.startswith("import time:") or "imported package" in line:
                continue
            self_us, cumulative_us, module = line.removeprefix("import time:").split("|")
            if module not in samples:
                order.append(module)
                samples[module] = []
            samples[module].append((float(self_us), float(cumulative_us)))
    return [
        (
            module,
            percentile([s for s, _ in samples[module]], 50),
            percentile([c for _, c in samples[module]], 50),
        )
        for module in order
    ]


def require_tools() -> None:
    if os.geteuid() != 0:
        raise BenchError("needs root (network namespaces, bridges)")
    for tool in ("hyperfine", "ip"):
        if shutil.which(tool) is None:
            raise BenchError(f"{tool} is not installed")
    for plugin in ("bridge", "host-local"):
        if not (REFERENCE_PLUGINS / plugin).exists():
            raise BenchError(f"{REFERENCE_PLUGINS / plugin} is missing (containernetworking)")
    if not os.access(PLUGIN_PYTHON, os.X_OK):
        raise BenchError(f"{PLUGIN_PYTHON} is missing: the plugin launcher needs it")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="timed ADDs per chain (>= 50)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed ADDs per chain first")
    parser.add_argument("--startup-runs", type=int, default=300, help="runs per start-up command")
    parser.add_argument("--tmp-dir", help="parent of the temp dirs (default /var/tmp)")
    parser.add_argument("--out", help="where hyperfine exports go (default: a kept temp dir)")
    parser.add_argument("--json", help="also write the summary as JSON to this file")
    args = parser.parse_args(argv)
    if args.runs < 50:
        parser.error("--runs must be at least 50")
    if not 1 <= args.warmup <= 1000 or not 10 <= args.startup_runs <= 5000:
        parser.error("--warmup must be in 1..1000 and --startup-runs in 10..5000")
    return args


def cleanup(sides: list[Side]) -> None:
    """Best effort, every step independent: DEL, then namespaces, then bridges."""
    for side in sides:
        if side.config_file.exists():
            try:
                side.run("DEL")
            except (OSError, subprocess.SubprocessError) as exc:
                log(f"cleanup: DEL on {side.label} failed: {exc}")
    for side in sides:
        subprocess.run(["ip", "netns", "del", side.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", side.bridge], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    workdir: Path | None = None
    daemon: Daemon | None = None
    sides: list[Side] = []
    try:
        require_tools()
        workdir = temp_work_dir("cns-plugin-add-", args.tmp_dir)
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="cns-bench-results-"))
        out.mkdir(parents=True, exist_ok=True)

        bin_dir = install_cni(workdir / "cni" / "bin")
        lib_dir = workdir / "cni" / "lib" / "cns"
        daemon = plugin_daemon(workdir, "10.241.0.0/16")
        facts = machine_facts(workdir)
        log(f"starting cns (state {daemon.state_dir}, {facts['stateDirFs']})")
        daemon.start()
        daemon.wait_pool(lambda p: p["ips"]["Available"] > 0, "an Available IP")

        tag = os.getpid() % 100000
        host_local = {
            "type": "host-local",
            "subnet": "10.250.0.0/16",
            "dataDir": str(workdir / "host-local"),
        }
        cns_ipam = {
            "type": "cns-ipam",
            "socket": str(daemon.socket),
            "releaseQueueDir": str(daemon.state_dir / "release-queue"),
        }
        for label, short, ipam, cni_path in (
            ("bridge + host-local", "hl", host_local, str(REFERENCE_PLUGINS)),
            ("bridge + cns-ipam", "cns", cns_ipam, f"{REFERENCE_PLUGINS}:{bin_dir}"),
        ):
            config = {
                "cniVersion": "1.0.0",
                "name": f"bench-{short}",
                "type": "bridge",
                "bridge": f"cnsb{short}{tag}",
                "isGateway": True,
                "ipMasq": False,
                "ipam": ipam,
            }
            side = Side(
                label,
                str(config["bridge"]),
                f"cnsbench-{short}-{tag}",
                f"bench-{short}-{tag}",
                cni_path,
                config,
                workdir / f"{short}.json",
            )
            side.config_file.write_text(json.dumps(config))
            sides.append(side)
            subprocess.run(["ip", "netns", "add", side.netns], check=True)
            added = side.run("ADD")
            if added.returncode != 0:
                raise BenchError(f"{label}: ADD failed: {added.stdout} {added.stderr}")
            address = json.loads(added.stdout)["ips"][0]["address"]
            log(f"{label}: ADD works ({address} in {side.netns} on {side.bridge})")
            deleted = side.run("DEL")
            if deleted.returncode != 0:
                raise BenchError(f"{label}: DEL failed: {deleted.stdout} {deleted.stderr}")

        before = daemon.metrics()
        add = hyperfine(
            [(s.label, s.shell("ADD")) for s in sides],
            out,
            "plugin_add",
            args.runs,
            args.warmup,
            [arg for s in sides for arg in ("--prepare", s.shell("DEL"))],
        )
        after = daemon.metrics()
        handled = metric_sum(after, ADD_METRIC.format("count")) - metric_sum(
            before, ADD_METRIC.format("count")
        )
        handled_seconds = metric_sum(after, ADD_METRIC.format("sum")) - metric_sum(
            before, ADD_METRIC.format("sum")
        )
        pool = daemon.pool()
        if pool["ips"]["Assigned"] != 1:  # the last timed ADD's IP
            raise BenchError(f"expected exactly 1 Assigned after the runs: {pool['ips']}")
        for side in sides:
            if side.run("DEL").returncode != 0:
                raise BenchError(f"{side.label}: DEL after the runs failed")
        daemon.wait_pool(lambda p: p["ips"]["Assigned"] == 0, "0 Assigned after the last DEL")

        # The IPAM plugins alone (as bridge calls them), under other container IDs.
        ipam_plugins = (REFERENCE_PLUGINS / "host-local", bin_dir / "cns-ipam")
        ipam_only = hyperfine(
            [
                (f"{p.name} (IPAM alone)", s.shell("ADD", p, f"{s.container_id}-ipam"))
                for s, p in zip(sides, ipam_plugins, strict=True)
            ],
            out,
            "ipam_add",
            args.runs,
            args.warmup,
            [
                arg
                for s, p in zip(sides, ipam_plugins, strict=True)
                for arg in ("--prepare", s.shell("DEL", p, f"{s.container_id}-ipam"))
            ],
        )
        for side, plugin in zip(sides, ipam_plugins, strict=True):
            subprocess.run(
                ["sh", "-c", side.shell("DEL", plugin, f"{side.container_id}-ipam")],
                check=True,
                capture_output=True,
            )
        startup = hyperfine(
            [
                ("cns-ipam VERSION", str(bin_dir / "cns-ipam")),
                ("python3 -IS -c pass", f"{PLUGIN_PYTHON} -IS -c pass"),
                ("host-local VERSION", str(REFERENCE_PLUGINS / "host-local")),
            ],
            out,
            "plugin_startup",
            args.startup_runs,
            20,
            ["-N"],
            env={**os.environ, "CNI_COMMAND": "VERSION"},
        )
        imports = import_times(lib_dir, 15)

        print("pod ADD through the reference bridge plugin: host-local vs cns-ipam")
        print_facts(facts)
        print(f"  results     {out}")
        print()
        print_stats("bridge ADD (hyperfine, one invocation, DEL as --prepare):", add)
        hl, cns = add["bridge + host-local"], add["bridge + cns-ipam"]
        ratio_mean = cns["mean"] / hl["mean"]
        ratio_median = cns["median"] / hl["median"]
        print(f"  ratio cns-ipam / host-local: mean {ratio_mean:.2f}x, median {ratio_median:.2f}x")
        if handled:
            print(
                f"  daemon side: {handled:.0f} ADDs handled, mean "
                f"{1000 * handled_seconds / handled:.2f} ms each (includes the durable commit)"
            )
        print()
        print_stats("IPAM plugin alone, ADD (no bridge; DEL as --prepare):", ipam_only)
        print()
        print_stats("plugin start-up (hyperfine -N, CNI_COMMAND=VERSION):", startup)
        print()
        print(f"python3 -IS -X importtime of cni_plugin.ipam (median of 15), {PLUGIN_PYTHON}:")
        print(f"  {'self us':>8} {'cumul us':>9}  module")
        for module, self_us, cumulative_us in imports:
            print(f"  {self_us:>8.0f} {cumulative_us:>9.0f}  {module}")
        verdict = "MET" if ratio_mean <= TARGET_RATIO else "NOT MET"
        print(
            f"\ntarget: bridge + cns-ipam ADD within {TARGET_RATIO:g}x of bridge + host-local: "
            f"{ratio_mean:.2f}x (mean) -> {verdict}"
        )
        if args.json:
            report = {
                "machine": facts,
                "bridgeAdd": add,
                "ratioMean": ratio_mean,
                "ratioMedian": ratio_median,
                "daemonAddMeanMs": 1000 * handled_seconds / handled if handled else None,
                "ipamAdd": ipam_only,
                "startup": startup,
                "importTimeUs": [
                    {"module": m.strip(), "self": s, "cumulative": c} for m, s, c in imports
                ],
            }
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            print(f"results JSON: {args.json}")
        cleanup(sides)
        sides.clear()
        errors = daemon.log_errors()
        code = daemon.stop()
        if code != 0:
            raise BenchError(f"cns exited {code} on SIGTERM")
        if errors:
            raise BenchError(f"daemon logged {len(errors)} error(s), first: {errors[0][:300]}")
        return 0
    except (BenchError, OSError, subprocess.CalledProcessError, ValueError, KeyError) as exc:
        print(f"plugin_add: FAILED: {exc}", file=sys.stderr)
        if daemon is not None and daemon.proc is not None:
            print(daemon.log_tail(), file=sys.stderr)
        return 1
    finally:
        cleanup(sides)
        if daemon is not None:
            try:
                daemon.stop()
            except BenchError as exc:
                log(str(exc))
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
