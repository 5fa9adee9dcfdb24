"""The `cns` command: run the daemon, show its pool, install the CNI plugins."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cns import __version__
from cns.config import Config, ConfigError, load, with_overrides
from cns.logs import configure

DEFAULT_CONFIG = Path("/etc/cns/cns.yaml")
PLUGINS = {"cns-ipam": "cni_plugin.ipam", "cns-cni": "cni_plugin.cni"}
DEFAULT_DEBUG_URL = "http://127.0.0.1:10090"
# Where `cns status` looks when --debug-url is not given, e.g. a test cluster's random port.
DEBUG_URL_ENV = "CNS_DEBUG_URL"


def _run(args: argparse.Namespace) -> int:
    from cns.daemon import Daemon, DaemonError
    from cns.store import StateError

    try:
        if args.config:
            config = load(Path(args.config))
        elif DEFAULT_CONFIG.exists():
            config = load(DEFAULT_CONFIG)
        else:
            config = Config()
        config = with_overrides(
            config,
            socket_path=args.socket,
            state_dir=args.state_dir,
            debug_listen=args.debug_listen,
            node_name=args.node_name,
            kubeconfig=args.kubeconfig,
        )
    except ConfigError as exc:
        print(f"cns: configuration error: {exc}", file=sys.stderr)
        return 2
    configure(config.log_level, config.log_format)
    # A watchdog kill (SIGABRT) or a crash leaves every thread's stack in the log.
    faulthandler.enable()
    try:
        return asyncio.run(Daemon(config, reset_state=args.reset_state).run())
    except (StateError, DaemonError) as exc:
        print(f"cns: cannot start: {exc}", file=sys.stderr)
        return 1


def _controller(args: argparse.Namespace) -> int:
    configure(args.log_level, args.log_format)
    return asyncio.run(run_controller(args))


async def run_controller(args: argparse.Namespace) -> int:
    import structlog
    from kubernetes_asyncio import client
    from kubernetes_asyncio import config as kubeconfig

    from cns.controller.run import Controller

    settings = client.Configuration()
    try:
        if args.kubeconfig:
            await kubeconfig.load_kube_config(
                config_file=args.kubeconfig, client_configuration=settings
            )
        else:
            kubeconfig.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=settings
            )
    except Exception as exc:
        print(f"cns controller: cannot load Kubernetes credentials: {exc}", file=sys.stderr)
        return 1
    async with client.ApiClient(settings) as api:
        controller = Controller(
            api, args.subnet, args.namespace, args.identity or "", lease_seconds=args.lease_seconds
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runner = None
        if args.metrics_listen:
            from aiohttp import web

            from cns.controller.metrics import build_app

            host, _, port = args.metrics_listen.rpartition(":")
            runner = web.AppRunner(build_app(controller), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, host.strip("[]") or None, int(port)).start()
        running = asyncio.create_task(controller.run(), name="controller")
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([running, stopping], return_when=asyncio.FIRST_COMPLETED)
        running.cancel()
        stopping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        # Hand over at once: a standby need not wait for the lease to expire.
        await controller.elector.release()
        if runner is not None:
            await runner.cleanup()
        structlog.get_logger("cns.controller").info(
            "controller_stopped", identity=controller.identity
        )
    return 0


def _fetch(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def _status(args: argparse.Namespace) -> int:
    base = (args.debug_url or os.environ.get(DEBUG_URL_ENV) or DEFAULT_DEBUG_URL).rstrip("/")
    try:
        pool = _fetch(f"{base}/debug/pool")
        ips = _fetch(f"{base}/debug/ips")["ips"] if args.ips else []
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"cns status: cannot read {base}/debug/pool: {exc}", file=sys.stderr)
        print(
            f"  (is a daemon serving its debugListen there? Point at another with --debug-url "
            f"or {DEBUG_URL_ENV}; `make cluster-up` prints the line to use)",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps({"pool": pool, "ips": ips} if args.ips else pool, indent=2))
        return 0
    print(render_pool(pool))
    if args.ips:
        print()
        print(render_ips(ips))
    return 0


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def render_pool(pool: dict[str, Any]) -> str:
    """The pool as two small tables: scaling figures, then IPs per state."""
    exhausted = "yes" if pool["subnetExhausted"] else "no"
    figures = [
        ("FIELD", "VALUE"),
        ("batchSize", f"{pool['batchSize']} (scaler {pool['scalerBatchSize']})"),
        ("requestThresholdPercent", str(pool["requestThresholdPercent"])),
        ("releaseThresholdPercent", str(pool["releaseThresholdPercent"])),
        ("maxIPCount", str(pool["maxIPCount"])),
        ("primaryIPCount", str(pool["primaryIPCount"])),
        ("demand", f"{pool['demand']} ({pool['waitingAdds']} waiting, {pool['podDemand']} pods)"),
        ("requestedIPCount", str(pool["requestedIPCount"])),
        ("targetIPCount", str(pool["targetIPCount"])),
        ("ipsNotInUse", str(len(pool["ipsNotInUse"]))),
        ("subnetExhausted", exhausted),
    ]
    states = [("STATE", "IPS"), *((k, str(v)) for k, v in pool["ips"].items())]
    return _table(figures) + "\n\n" + _table(states)


def render_ips(ips: list[dict[str, Any]]) -> str:
    rows = [("ADDRESS", "STATE", "CONTAINER", "IFNAME", "POD")]
    for ip in ips:
        owner = ip["owner"] or {}
        pod = f"{owner.get('podNamespace', '')}/{owner.get('podName', '')}".strip("/")
        rows.append(
            (
                ip["address"],
                ip["state"],
                owner.get("containerID", "")[:12],
                owner.get("ifName", ""),
                pod,
            )
        )
    return _table(rows)


def _launcher(python: str, lib_dir: Path, module: str) -> str:
    """A shebang passes one argument: `-IS` (isolated, no site) must be a single word."""
    return (
        f"#!{python} -IS\n"
        '"""Written by `cns install-cni`: a stdlib-only CNI plugin, started once per pod."""\n'
        "import sys\n"
        f"sys.path.insert(0, {str(lib_dir)!r})\n"
        f"from {module} import main\n"
        "sys.exit(main())\n"
    )


def install_cni(bin_dir: Path, lib_dir: Path, python: str) -> list[Path]:
    """Copy the plugin package to `lib_dir` and write one launcher per plugin into `bin_dir`."""
    import cni_plugin

    package = Path(cni_plugin.__file__).parent
    target = lib_dir / "cni_plugin"
    target.mkdir(parents=True, exist_ok=True)
    for source in package.glob("*.py"):
        shutil.copyfile(source, target / source.name)
    # Precompile for the plugin's interpreter: a read-only dir would otherwise recompile per pod.
    subprocess.run([python, "-m", "compileall", "-q", str(target)], check=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, module in PLUGINS.items():
        path = bin_dir / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(_launcher(python, lib_dir, module))
        tmp.chmod(0o755)
        os.replace(tmp, path)
        written.append(path)
    return written


def _default_python() -> str:
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def conflist(name: str, socket_path: str, release_queue_dir: str, mtu: int) -> dict[str, Any]:
    """The node's network: cns-cni first, then the reference portmap for hostPort mappings."""
    return {
        "cniVersion": "1.0.0",
        "name": name,
        "plugins": [
            {
                "type": "cns-cni",
                "socket": socket_path,
                "releaseQueueDir": release_queue_dir,
                "mtu": mtu,
            },
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": True},
        ],
    }


def _install_cni(args: argparse.Namespace) -> int:
    bin_dir = Path(args.bin_dir)
    lib_dir = Path(args.lib_dir) if args.lib_dir else bin_dir.parent / "lib" / "cns"
    for path in install_cni(bin_dir, lib_dir, args.python or _default_python()):
        print(f"installed {path}")
    if args.conf_dir:
        conf_dir = Path(args.conf_dir)
        conf_dir.mkdir(parents=True, exist_ok=True)
        path = conf_dir / "10-cns.conflist"
        body = conflist(args.network_name, args.socket, args.release_queue_dir, args.mtu)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        os.replace(tmp, path)
        print(f"installed {path}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from cns.sim.engine import simulate
    from cns.sim.progress import ProgressBar
    from cns.sim.report import summary_rows, to_json
    from cns.sim.scenario import load
    from cns.sim.strategies import DEFAULT_STRATEGIES, STRATEGIES

    try:
        scenario = load(Path(args.file))
    except ConfigError as exc:
        print(f"cns simulate: {exc}", file=sys.stderr)
        return 2
    names = args.strategy or scenario.strategies or DEFAULT_STRATEGIES
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown:
        known = ", ".join(STRATEGIES)
        print(f"cns simulate: unknown strategy {unknown[0]!r}; known: {known}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            from cns.sim.plot import write_charts
        except ImportError as exc:
            print(f"cns simulate: --plot needs matplotlib (cns[sim]): {exc}", file=sys.stderr)
            return 2
    seed = scenario.seed if args.seed is None else args.seed
    show_progress = args.progress or sys.stderr.isatty()
    bar = ProgressBar(sys.stderr, len(names)) if show_progress else None
    results = []
    for index, name in enumerate(names):
        progress = bar.run(index, name) if bar is not None else None
        results.append(simulate(scenario, STRATEGIES[name], seed, progress))
    if bar is not None:
        bar.close()
    if args.plot:
        for path in write_charts(results, Path(args.plot), scenario.name):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(to_json(scenario, seed, results), indent=2))
        return 0
    print(f"scenario {scenario.name}: {scenario.duration_seconds:g} simulated seconds, seed {seed}")
    print(_table(summary_rows(results)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cns", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cns {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the node daemon in the foreground")
    run.add_argument("--config", help=f"YAML config file (default {DEFAULT_CONFIG} if present)")
    run.add_argument("--socket", help="unix socket for the CNI plugins (overrides socketPath)")
    run.add_argument("--state-dir", help="directory for durable state (overrides stateDir)")
    run.add_argument("--debug-listen", help="HOST:PORT of the debug endpoint (overrides file)")
    run.add_argument("--node-name", help="this node's name (overrides nodeName)")
    run.add_argument("--kubeconfig", help="kubeconfig file (overrides kubernetes.kubeconfig)")
    run.add_argument(
        "--reset-state",
        action="store_true",
        help="start with no assignments, moving state.db aside (kept as state.db.reset-<time>); "
        "only when no pod on this node holds an address",
    )
    run.set_defaults(func=_run)

    status = commands.add_parser("status", help="show the pool of a running daemon")
    status.add_argument(
        "--debug-url",
        metavar="URL",
        help=f"the daemon's debug endpoint, http://HOST:PORT of its debugListen (default: "
        f"${DEBUG_URL_ENV} if set, else {DEFAULT_DEBUG_URL})",
    )
    status.add_argument("--ips", action="store_true", help="also list every IP and its owner")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.set_defaults(func=_status)

    controller = commands.add_parser(
        "controller", help="run the reference subnet control plane (leader-elected)"
    )
    controller.add_argument("--subnet", required=True, help="ClusterSubnet to fulfil NNCs from")
    controller.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster)")
    controller.add_argument("--namespace", default="kube-system", help="namespace of the NNCs")
    controller.add_argument("--identity", help="leader-election identity (default: random)")
    controller.add_argument(
        "--lease-seconds",
        type=int,
        default=15,
        help="leader lease duration; renewals every duration/7.5, given up after 2/3 of it",
    )
    controller.add_argument(
        "--metrics-listen",
        default="",
        metavar="HOST:PORT",
        help="serve /metrics and /healthz here (default: off)",
    )
    controller.add_argument("--log-level", default="info")
    controller.add_argument("--log-format", default="auto", choices=("auto", "json", "console"))
    controller.set_defaults(func=_controller)

    simulate = commands.add_parser(
        "simulate", help="compare IP strategies on a simulated cluster (docs/simulate.md)"
    )
    simulate.add_argument("file", help="scenario YAML file, e.g. bench/scenarios/example.yaml")
    simulate.add_argument(
        "--strategy",
        action="append",
        help="fixed, toggle, phase4 or phase4+toggle (repeatable; default: the scenario's "
        "strategies, else fixed, toggle and phase4)",
    )
    simulate.add_argument("--seed", type=int, help="random seed (default: the scenario's)")
    simulate.add_argument("--json", action="store_true", help="print JSON instead of a table")
    simulate.add_argument("--plot", metavar="DIR", help="write PNG charts into DIR")
    simulate.add_argument(
        "--progress", action="store_true", help="show the progress bar even if not on a terminal"
    )
    simulate.set_defaults(func=_simulate)

    install = commands.add_parser("install-cni", help="install the CNI plugin executables")
    install.add_argument("--bin-dir", required=True, help="CNI bin dir, e.g. /opt/cni/bin")
    install.add_argument("--lib-dir", help="where the plugin code goes (default BIN/../lib/cns)")
    install.add_argument("--python", help="interpreter for the plugins (default /usr/bin/python3)")
    install.add_argument("--conf-dir", help="also write 10-cns.conflist here (/etc/cni/net.d)")
    install.add_argument("--network-name", default="cns", help="network name in the conflist")
    install.add_argument("--socket", default="/run/cns/cns.sock", help="daemon socket")
    install.add_argument(
        "--release-queue-dir",
        default="/var/lib/cns/release-queue",
        help="<stateDir>/release-queue of the daemon",
    )
    install.add_argument("--mtu", type=int, default=1500, help="pod interface MTU")
    install.set_defaults(func=_install_cni)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
