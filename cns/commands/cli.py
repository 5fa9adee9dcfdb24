"""The `cns` command: run the daemon, show its pool, install the CNI plugins.

Parsing and dispatch only: each command's work is in its own module, imported when the command
runs, so that `cns run` does not pay for what `cns simulate` needs.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import os
import shutil
import subprocess
import sys
from pathlib import Path

from cns import __version__
from cns.config.daemon_config import Config, ConfigError, load, with_overrides
from cns.kube import NAMESPACE
from cns.support.logs import configure

DEFAULT_CONFIG = Path("/etc/cns/cns.yaml")
DEFAULT_DEBUG_URL = "http://127.0.0.1:10090"
# Where `cns status` looks when --debug-url is not given, e.g. a test cluster's random port.
DEBUG_URL_ENV = "CNS_DEBUG_URL"


def _run(args: argparse.Namespace) -> int:
    from cns.commands.daemon import Daemon, DaemonError
    from cns.state.store import StateError

    path = Path(args.config) if args.config else DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None

    def read_config() -> Config:
        """The configuration as the file says now, with the command line's flags over it (the
        daemon reads it again on SIGHUP: docs/kubernetes.md, reserved ranges)."""
        return with_overrides(
            load(path) if path is not None else Config(),
            socket_path=args.socket,
            state_dir=args.state_dir,
            debug_listen=args.debug_listen,
            node_name=args.node_name,
            kubeconfig=args.kubeconfig,
            metrics_address=args.metrics_address,
        )

    try:
        config = read_config()
    except ConfigError as exc:
        print(f"cns: configuration error: {exc}", file=sys.stderr)
        return 2
    configure(config.log_level, config.log_format)
    # A watchdog kill (SIGABRT) or a crash leaves every thread's stack in the log.
    faulthandler.enable()
    try:
        daemon = Daemon(config, reset_state=args.reset_state, read_config=read_config)
        return asyncio.run(daemon.run())
    except (StateError, DaemonError) as exc:
        print(f"cns: cannot start: {exc}", file=sys.stderr)
        return 1


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _controller(args: argparse.Namespace) -> int:
    from cns.commands.controller import run_controller
    from cns.kube.client import CredentialsError

    configure(args.log_level, args.log_format)
    try:
        return asyncio.run(
            run_controller(
                subnet=args.subnet,
                kubeconfig=args.kubeconfig or "",
                namespace=args.namespace,
                identity=args.identity or "",
                lease_seconds=args.lease_seconds,
                metrics_listen=args.metrics_listen,
                qps=args.kube_api_qps,
                burst=args.kube_api_burst,
            )
        )
    except CredentialsError as exc:
        print(f"cns controller: {exc}", file=sys.stderr)
        return 1


def _configured(config_file: Path) -> Config:
    """The config `cns run` starts with from `config_file`; no file, or one that does not load,
    is the built-in default."""
    try:
        return load(config_file) if config_file.exists() else Config()
    except ConfigError:
        return Config()


def configured_debug_url(config_file: Path = DEFAULT_CONFIG) -> str:
    """The debug endpoint `cns run` serves with its default config file, as `cns status` asks
    it: `kubectl exec ds/cns -- cns status` runs beside a daemon whose debugListen is the
    ConfigMap's, whichever port an operator chose there. A wildcard address is asked on the
    loopback."""
    host, port = _configured(config_file).debug_host_port
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _status(args: argparse.Namespace) -> int:
    from cns.commands.status import Endpoint, show_status

    if args.debug_url:
        endpoints = [Endpoint(url=args.debug_url)]
    elif args.debug_socket:
        endpoints = [Endpoint(socket=args.debug_socket)]
    elif os.environ.get(DEBUG_URL_ENV):
        endpoints = [Endpoint(url=os.environ[DEBUG_URL_ENV])]
    else:  # the root-only socket, which no squatter on the port can answer for; then the port
        config_file = Path(args.config)
        socket_path = _configured(config_file).debug_socket_path
        endpoints = [
            Endpoint(socket=str(socket_path)),
            Endpoint(url=configured_debug_url(config_file)),
        ]
    return show_status(endpoints, ips=args.ips, as_json=args.json, pod=args.pod or "")


def _ipam(args: argparse.Namespace) -> int:
    from cns.commands import ipam

    kubeconfig = args.kubeconfig or ipam.default_kubeconfig()
    where = {"kubeconfig": kubeconfig, "namespace": args.namespace}
    name = f"cns ipam {args.ipam_command}"
    if args.ipam_command == "show":
        return ipam.run(ipam.show, name, **where, as_json=args.output == "json", blocks=args.blocks)
    if args.ipam_command == "check":
        return ipam.run(
            ipam.run_check,
            name,
            **where,
            as_json=args.output == "json",
            output_report=args.output_report or "",
            only_problems=args.show_problem_ips,
        )
    return ipam.run(
        ipam.release,
        name,
        **where,
        report_file=args.from_report,
        dry_run=args.dry_run,
        grace_seconds=args.grace,
    )


def _install_cni(args: argparse.Namespace) -> int:
    from cns.commands import install

    bin_dir = Path(args.bin_dir)
    lib_dir = Path(args.lib_dir) if args.lib_dir else install.default_lib_dir(bin_dir)
    python = args.python or install.default_python()
    for path in install.install_cni(bin_dir=bin_dir, lib_dir=lib_dir, python=python):
        print(f"installed {path}")
    if args.conf_dir:
        body = install.conflist(
            name=args.network_name,
            socket_path=args.socket,
            release_queue_dir=args.release_queue_dir,
            mtu=args.mtu,
        )
        path, _ = install.write_conflist(Path(args.conf_dir), body)
        print(f"installed {path}")
    return 0


def _install_seccomp_profile(args: argparse.Namespace) -> int:
    from cns.commands import install

    path, _ = install.install_seccomp_profile(Path(args.dir))
    print(f"installed {path}")
    return 0


def _install(args: argparse.Namespace) -> int:
    from cns.commands import systemd_install as sd

    if not args.systemd:
        print("cns install: say --systemd (the node as a systemd service; on a Kubernetes node "
              "the DaemonSet runs `cns install-cni`)", file=sys.stderr)  # fmt: skip
        return 2
    paths = {"--root": args.root, "--bin-dir": args.bin_dir, "--conf-dir": args.conf_dir,
             "--cns": args.cns, "--python": args.python}  # fmt: skip
    relative = [f"{flag} {value}" for flag, value in paths.items() if value and value[0] != "/"]
    executable = Path(args.cns) if args.cns else sd.default_executable()
    if relative or executable is None:
        why = f"absolute paths only: {', '.join(relative)}" if relative else "no cns on $PATH"
        print(f"cns install: {why}", file=sys.stderr)
        return 2
    layout = sd.Layout(
        root=Path(args.root),
        config=DEFAULT_CONFIG,
        executable=executable,
        bin_dir=Path(args.bin_dir),
        conf_dir=Path(args.conf_dir),
        python=args.python,
        mtu=args.mtu,
    )
    live = layout.root == Path("/")
    systemctl = shutil.which("systemctl")
    booted = sd.SYSTEMD_BOOTED.is_dir()
    start = not args.no_start and not args.uninstall
    problems = sd.preflight(layout, euid=os.geteuid(), booted=booted, systemctl=systemctl,
                            start=start, installing=not args.uninstall)  # fmt: skip
    if problems:
        for problem in problems:
            print(f"cns install: {problem}", file=sys.stderr)
        return 1
    usable = systemctl is not None and (booted or not live)
    systemd = sd.Systemd(systemctl, layout.root, print) if systemctl and usable else None
    if systemd is None:
        print("systemd is not running: only the files are written or removed")
    try:
        if args.uninstall:
            sd.uninstall_systemd(layout, systemd, print)
        else:
            sd.install_systemd(layout, systemd, print, start=start)
    except (sd.InstallError, OSError, subprocess.SubprocessError) as exc:
        print(f"cns install: {exc}", file=sys.stderr)
        return 1
    return 0


def _uninstall_cni(args: argparse.Namespace) -> int:
    from cns.commands import install

    if args.unless_daemonset_alive:
        namespace, _, name = args.unless_daemonset_alive.rpartition("/")
        status, deleting = asyncio.run(
            install.ask_daemonset(namespace or NAMESPACE, name, timeout=args.api_timeout)
        )
        remove, why = install.uninstall_verdict(status, deleting)
        print(f"DaemonSet {namespace or NAMESPACE}/{name}: {why}")
        if not remove:
            return 0
    bin_dir = Path(args.bin_dir)
    for path in install.uninstall_cni(
        bin_dir=bin_dir,
        lib_dir=Path(args.lib_dir) if args.lib_dir else install.default_lib_dir(bin_dir),
        conf_dir=Path(args.conf_dir) if args.conf_dir else None,
    ):
        print(f"removed {path}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from cns.sim.command import run_simulation

    return run_simulation(
        Path(args.file),
        strategies=args.strategy,
        seed=args.seed,
        plot=Path(args.plot) if args.plot else None,
        as_json=args.json,
        progress=args.progress,
    )


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
    run.add_argument(
        "--metrics-address",
        help="the address of the /metrics-only listener, e.g. the node's (overrides "
        'metrics.address; "" turns it off)',
    )
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
        f"${DEBUG_URL_ENV} if set, else the debugSocketPath of {DEFAULT_CONFIG} (or /run/cns/"
        f"debug.sock), else its debugListen (or {DEFAULT_DEBUG_URL}))",
    )
    status.add_argument("--ips", action="store_true", help="also list every IP and its owner")
    status.add_argument(
        "--pod",
        metavar="NAMESPACE/NAME",
        help="explain one pod: its IP, or what it waits for (pool, subnet, cooldown), with figures",
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument(
        "--debug-socket",
        metavar="PATH",
        help="the daemon's debug unix socket (its debugSocketPath; root only). Without this, "
        "--debug-url or $CNS_DEBUG_URL, the debugSocketPath of --config is read first and "
        "its debugListen only when the socket cannot be connected to",
    )
    status.add_argument(
        "--config",
        metavar="FILE",
        default=str(DEFAULT_CONFIG),
        help=f"the daemon's config file, for its debugSocketPath and debugListen "
        f"(default: {DEFAULT_CONFIG})",
    )
    status.set_defaults(func=_status)

    controller = commands.add_parser(
        "controller", help="run the reference subnet control plane (leader-elected)"
    )
    controller.add_argument(
        "--subnet",
        default="",
        help="serve only this ClusterSubnet, with a lease of its own (default: every "
        "ClusterSubnet, one lease; docs/kubernetes.md, 'Several subnets')",
    )
    controller.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster)")
    controller.add_argument("--namespace", default=NAMESPACE, help="namespace of the NNCs")
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
    controller.add_argument(
        "--kube-api-qps",
        type=_non_negative_float,
        default=200.0,
        help="client-side limit of API requests a second, as client-go's (0: none; "
        "docs/kubernetes.md says why the default)",
    )
    controller.add_argument(
        "--kube-api-burst",
        type=_positive_int,
        default=400,
        help="API requests allowed at once after a quiet spell",
    )
    controller.add_argument("--log-level", default="info")
    controller.add_argument("--log-format", default="auto", choices=("auto", "json", "console"))
    controller.set_defaults(func=_controller)

    ipam = commands.add_parser(
        "ipam",
        help="the whole cluster's addresses: show utilization, check consistency, release "
        "leaks (docs/kubernetes.md, 'cns ipam')",
    )
    ipam_commands = ipam.add_subparsers(dest="ipam_command", required=True)
    ipam_show = ipam_commands.add_parser("show", help="utilization per ClusterSubnet and per node")
    ipam_show.add_argument(
        "--blocks", action="store_true", help="also list each node's granted address ranges"
    )
    ipam_check = ipam_commands.add_parser(
        "check",
        help="compare the allocation record, every NodeNetworkConfig and every pod; exit "
        "status: 0 clean, else the sum of 4 duplicates, 8 leaked, 16 unrecorded, 32 stale, "
        "64 unreadable (1: error)",
    )
    ipam_check.add_argument(
        "--output-report", metavar="FILE", help="also write the JSON report to FILE"
    )
    ipam_check.add_argument(
        "--show-problem-ips",
        action="store_true",
        help="print only the problems (no summary line when there are none)",
    )
    ipam_release = ipam_commands.add_parser(
        "release", help="free the addresses a check report proved leaked, each checked again"
    )
    ipam_release.add_argument(
        "--from-report", required=True, metavar="FILE", help="a report of `cns ipam check`"
    )
    ipam_release.add_argument(
        "--dry-run", action="store_true", help="say what would be released; write nothing"
    )
    ipam_release.add_argument(
        "--grace",
        type=_non_negative_float,
        default=60.0,
        metavar="SECONDS",
        help="release only leaks the report saw at least this long ago (default 60): a grant "
        "being completed looks like a leak for a moment",
    )
    for sub in (ipam_show, ipam_check, ipam_release):
        sub.add_argument(
            "--kubeconfig",
            help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, else in-cluster)",
        )
        sub.add_argument("--namespace", default=NAMESPACE, help="namespace of the NNCs")
        if sub is not ipam_release:
            sub.add_argument("-o", "--output", choices=("table", "json"), default="table")
    ipam.set_defaults(func=_ipam)

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

    seccomp = commands.add_parser(
        "install-seccomp-profile",
        help="write the DaemonSet's seccomp profile for the kubelet (its init container)",
    )
    seccomp.add_argument(
        "--dir", required=True, help="e.g. /var/lib/kubelet/seccomp/cns (in the kubelet's dir)"
    )
    seccomp.set_defaults(func=_install_seccomp_profile)

    node = commands.add_parser(
        "install",
        help="install cns on this node as a systemd service: unit, config, CNI plugins (README, "
        "'Running under systemd')",
    )
    node.add_argument(
        "--systemd", action="store_true", help="as a systemd service (the only kind so far)"
    )
    node.add_argument(
        "--uninstall",
        action="store_true",
        help="stop and disable the service and remove what install wrote (the state directory "
        "and an edited config stay)",
    )
    node.add_argument(
        "--no-start", action="store_true", help="write the files only (no enable, no start)"
    )
    node.add_argument(
        "--root",
        default="/",
        metavar="DIR",
        help="stage into the root file system DIR (enabled offline, started at its boot)",
    )
    node.add_argument(
        "--cns",
        metavar="PATH",
        help="the cns executable the unit starts (default: the one running this command)",
    )
    node.add_argument("--bin-dir", default="/opt/cni/bin", help="CNI bin dir for the plugins")
    node.add_argument("--conf-dir", default="/etc/cni/net.d", help="where 10-cns.conflist goes")
    node.add_argument("--python", default="/usr/bin/python3", help="interpreter for the plugins")
    node.add_argument("--mtu", type=int, default=1500, help="pod interface MTU (conflist)")
    node.set_defaults(func=_install)
    uninstall = commands.add_parser(
        "uninstall-cni", help="remove what install-cni wrote (the DaemonSet's preStop hook)"
    )
    uninstall.add_argument("--bin-dir", required=True, help="CNI bin dir, e.g. /opt/cni/bin")
    uninstall.add_argument("--lib-dir", help="the plugin code's dir (default BIN/../lib/cns)")
    uninstall.add_argument("--conf-dir", help="also remove 10-cns.conflist here (/etc/cni/net.d)")
    uninstall.add_argument(
        "--unless-daemonset-alive",
        metavar="[NAMESPACE/]NAME",
        help="first ask the API server (in-cluster service account) for this DaemonSet, the "
        "pod's own: while it exists and is not being deleted, keep the files (an upgrade or a "
        "restart; a new pod follows); remove them when it is gone or being deleted, or when the "
        "account is refused; keep them when there is no answer",
    )
    uninstall.add_argument(
        "--api-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long to wait for the API server's answer (it counts against the pod's grace "
        "period)",
    )
    uninstall.set_defaults(func=_uninstall_cni)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
