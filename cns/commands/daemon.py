"""Wiring: build the pieces from the config, run them, stop them cleanly.

Start-up order matters for correctness: the state directory is locked first (one daemon per
directory) and checked for lost state, durable assignments are restored next, then the network
container is learnt, queued DELs are applied, and only then does the socket answer ADDs (and
systemd hears READY=1). ADDs that need a new IP wait until the world (the runtime's sandboxes,
the API's pods) has checked the state file (cns/node/startup_check.py), for at most
WORLD_CHECK_WAIT_SECONDS.

Shutdown (SIGTERM, SIGINT) is bounded: every listener stops accepting at once, ADDs waiting for an
IP are refused at once, requests in flight get SHUTDOWN_GRACE_SECONDS to finish (their commits
are flushed), and whatever is still open after that is closed. SIGHUP recomputes the pool request
and drains the release queue now (standalone: and reads `reservedIPs` again); SIGUSR1/SIGUSR2 log
a one-line pool summary (README, "Signals").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from cns.config.daemon_config import Config, ConfigError
from cns.core.flat_network import UplinkError
from cns.core.pool import Assignment, Pool
from cns.host.cri import CriSandboxes
from cns.host.sdnotify import notify, watchdog_forever, watchdog_interval
from cns.node.attachments import Attachments
from cns.node.control_plane import NCSource, SubnetChooser, configured_subnets
from cns.node.errors import IPAMError
from cns.node.flat_network import FlatNetwork
from cns.node.leak_reclaim import LeakReclaimer, PodsOnNode
from cns.node.notes import NodeEvents
from cns.node.service import NodeIPAM
from cns.node.standalone import StandaloneSource
from cns.node.startup_check import PodAddresses, WorldCheck
from cns.state.statedir import StateDirLock, refuse_lost_state, reset_state
from cns.state.store import Store
from cns.web import api, debug, listeners, views
from cns.web.node_metrics import Metrics

if TYPE_CHECKING:  # imported when needed: standalone nodes need not pay for kubernetes_asyncio
    from cns.kube.client import KubeClient
    from cns.kube.events import EventRecorder
    from cns.node.ip_pressure import PressureReporter
    from cns.node.kube_source import KubeSource

log = structlog.get_logger("cns.daemon")

RELEASE_QUEUE_INTERVAL_SECONDS = 5.0
STORAGE_PROBE_SECONDS = 1.0
# Well under systemd's TimeoutStopSec=20 (systemd/cns.service): aiohttp waits this long for a
# handler, then as long again for its cancellation, which is immediate for every cns handler.
SHUTDOWN_GRACE_SECONDS = 5.0
# The longest the start-up check waits for the runtime and the API (and at most half an ADD's
# timeout, so the ADDs waiting for it get an answer): then it goes on without the missing one.
WORLD_CHECK_WAIT_SECONDS = 5.0
# How often a debug or metrics port that another process holds is tried again.
DEBUG_LISTEN_RETRY_SECONDS = 2.0


class DaemonError(Exception):
    """A start-up problem the operator must fix; the message says what and where."""


def _claim_socket(path: Path) -> None:
    """Remove a stale socket file, but refuse to steal one a live daemon is serving."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    if not path.exists() and not path.is_symlink():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
        return
    finally:
        probe.close()
    raise DaemonError(f"another process is serving {path}; is cns already running?")


class Daemon:
    """One running cns: the node service, its HTTP servers (the CNI socket; the debug endpoint
    on a unix socket and a port) and background tasks."""

    def __init__(
        self,
        config: Config,
        reset_state: bool = False,
        read_config: Callable[[], Config] | None = None,
    ) -> None:
        self.config = config
        # Reads the configuration file again (SIGHUP): a standalone node's reservedIPs.
        self._read_config = read_config
        self._standalone: StandaloneSource | None = None
        self.reset_state = reset_state
        self.metrics = Metrics()
        self.store = Store(config.state_file, on_commit=self.metrics.commit_seconds.observe)
        self._kube: KubeClient | None = None
        self.stop_requested = asyncio.Event()
        self._serving: dict[str, bool] = {}
        self._runners: list[web.AppRunner] = []
        self._sites: list[listeners.CappedSite] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._owned_sockets: list[Path] = []
        self._debug_port = listeners.ListenerStatus(config.debug_listen, "debug")
        self._metrics_port = (
            listeners.ListenerStatus(config.metrics.url, "metrics")
            if config.metrics.address
            else None
        )
        self._port_retries: list[asyncio.Task[None]] = []
        self._node: NodeIPAM | None = None
        self._events = NodeEvents()  # Kubernetes mode: what operators see as Events
        self._recorder: EventRecorder | None = None
        self._runtime: CriSandboxes | None = None
        self._pods_on_node: PodsOnNode | None = None  # Kubernetes mode: the leak check reads them
        self._pod_addresses: PodAddresses | None = None  # Kubernetes mode: the world check's
        self._pressure: PressureReporter | None = None  # Kubernetes mode, ipPressure.enabled
        # Kubernetes mode: the pod's and its namespace's annotations choose its subnets.
        self._choose_subnets: SubnetChooser = configured_subnets
        self.metrics.watch_connections(lambda: [site.cap for site in self._sites])
        self.metrics.watch_listener(self._debug_port)
        if self._metrics_port is not None:
            self.metrics.watch_listener(self._metrics_port)
        self.metrics.watch_readiness(lambda: bool(self._serving.get("socket")))

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the process exit code."""
        lock = StateDirLock.acquire(self.config.state_dir)  # before anything touches the directory
        try:
            return await self._serve()
        finally:
            lock.release()

    def _restore_state(self) -> list[Assignment]:
        """The committed assignments, or none after the reset the operator asked for (the old
        files are kept under another name)."""
        config = self.config
        if self.reset_state:
            moved = reset_state(config.state_file)
            log.warning(
                "state_reset", state_dir=str(config.state_dir), moved=[str(p) for p in moved]
            )
        return self.store.open()

    async def _serve(self) -> int:
        config = self.config
        caps = listeners.connection_caps(listeners.raise_descriptor_limit())
        if not self.reset_state:  # before the allocator creates its file on a fresh node
            refuse_lost_state(config.state_dir, config.state_file)
        source = await self._source()  # a bad allocator file stops start-up before any reset
        try:
            assignments = self._restore_state()
        except BaseException:
            if self._kube is not None:
                await self._kube.close()
            raise
        node = NodeIPAM(  # restores the assignments and cooldowns into every lane
            Pool(),
            self.store,
            source,
            config.scaler,
            config.add_timeout_seconds,
            on_add_waited=self.metrics.add_wait_seconds.observe,
            coalescing=config.coalescing,
            cooldown_seconds=config.ip_cooldown_seconds,
            events=self._events,
        )
        self._node = node
        self.metrics.watch(node)
        self.attachments = Attachments(node, self.store)
        log.info(
            "cns_starting",
            node=config.node_name,
            mode=config.mode,
            state_file=str(config.state_file),
            restored_assignments=len(assignments),
        )
        self._handle_signals(node)
        try:
            await self._start_debug(node, caps)
            self._spawn(source.run(node.on_state), "nc-source")
            if self._recorder is not None:
                self._spawn(self._recorder.write_forever(), "events")
            self._spawn(node.reconcile_forever(), "reconcile")
            self._spawn(node.tick_forever(config.reconcile_interval_seconds), "tick")
            self._spawn(node.end_cooldowns_forever(), "cooldowns")
            self._spawn(self.store.recover_forever(STORAGE_PROBE_SECONDS), "storage-probe")
            await self._until_stopped(node.has_network.wait())
            if self.stop_requested.is_set():
                return 0
            if config.flat_network.enabled:  # the pod subnets are known from here on
                await self._start_flat_network(node)
            try:
                applied = await node.drain_release_queue(config.release_queue_dir)
            except IPAMError as exc:  # state cannot be committed now; the periodic drain retries
                log.error("release_queue_drain_failed", error=exc.msg)
                applied = 0
            self.metrics.release_queue_applied.inc(applied)
            self._start_world_check(node)
            self._start_ip_pressure(node)
            await self._start_socket(node, caps.socket)
            self._spawn(
                node.drain_release_queue_forever(
                    config.release_queue_dir, RELEASE_QUEUE_INTERVAL_SECONDS
                ),
                "release-queue",
            )
            self._spawn(self.attachments.reap_forever(config.attachment_check_seconds), "reap")
            if config.leak_reclaim.cri_socket:
                self._start_leak_check(node)
            notify("READY=1")
            # The watchdog runs from READY=1 on: systemd arms it only then (start-up is bounded by
            # TimeoutStartSec=), and a ping before READY=1 would arm it early.
            interval = watchdog_interval(os.environ, os.getpid())
            if interval is not None:
                self._spawn(watchdog_forever(interval), "watchdog")
            log.info(
                "cns_ready",
                socket=str(config.socket_path),
                debug=config.debug_listen,
                debug_serving=self._debug_port.serving,
                debug_socket=str(config.debug_socket_path),
            )
            await self._until_stopped(self.stop_requested.wait())
            return 0
        finally:
            await self._shutdown()

    async def _source(self) -> NCSource:
        """The standalone allocator, or the Kubernetes API for `mode: kubernetes`."""
        config = self.config
        if config.mode == "standalone":
            allocators = StandaloneSource(config.standalone, config.state_dir, scaler=config.scaler)
            allocators.load()
            self._standalone = allocators
            return allocators
        # Imported here: kubernetes_asyncio costs start-up time standalone nodes need not pay.
        from cns.kube.client import CredentialsError, connect
        from cns.node.kube_source import KubeSource

        try:
            self._kube = await connect(config.kubernetes.kubeconfig)
        except CredentialsError as exc:
            raise DaemonError(str(exc)) from exc
        source = KubeSource(
            self._kube,
            node_name=config.node_name,
            subnet_name=config.kubernetes.subnet_name,
            fallback_scaler=config.scaler,
            namespace=config.kubernetes.namespace,
            watch_timeout_seconds=config.kubernetes.watch_timeout_seconds,
            snapshot_path=config.state_dir / "kube-snapshot.json",
        )
        if config.kubernetes.events:
            self._start_events(source)
        self._pods_on_node = source.node_pods
        self._pod_addresses = source.live_pod_addresses
        self._choose_subnets = self._events.telling_invalid_subnets(source.choose_subnets)
        return source

    def _start_events(self, source: KubeSource) -> None:
        """The recorder of the node's Events (cns/kube/events.py), its counts in the metrics;
        its writer runs with the other tasks."""
        from cns.kube.events import EventCollector, EventRecorder

        assert self._kube is not None
        recorder = EventRecorder(
            self._kube, component="cns", host=self.config.node_name, uid_of=source.uid_of
        )
        self.metrics.registry.register(EventCollector(recorder, prefix="cns"))
        self._events = NodeEvents(recorder, source.nnc_ref)
        self._recorder = recorder

    def _cri(self) -> CriSandboxes | None:
        """The runtime's CRI client (config `leakReclaim.criSocket`), shared by the leak check and
        the world check; None when none is configured."""
        socket_path = self.config.leak_reclaim.cri_socket
        if socket_path and self._runtime is None:
            self._runtime = CriSandboxes(socket_path)
        return self._runtime

    def _start_world_check(self, node: NodeIPAM) -> None:
        """The state file checked by the world (cns/node/startup_check.py): ADDs wait from now on
        until it is done."""
        wait = min(WORLD_CHECK_WAIT_SECONDS, self.config.add_timeout_seconds / 2)
        check = WorldCheck(node, self._cri(), self._pod_addresses, wait_seconds=wait)
        check.close_gate()
        log.info(
            "world_check_starting",
            cri_socket=self.config.leak_reclaim.cri_socket or None,
            pods="kubernetes" if self._pod_addresses is not None else None,
            wait_seconds=wait,
            state=node.world.state,
        )
        self._spawn(check.run(), "world-check")

    async def _start_flat_network(self, node: NodeIPAM) -> None:
        """The uplink answers for the pods' addresses (cns/node/flat_network.py) before the
        socket serves any ADD; a missing or ambiguous uplink stops start-up, naming the key."""
        flat = FlatNetwork(
            node,
            uplink=self.config.flat_network.uplink,
            on_announce_failed=self.metrics.announcements_failed.inc,
        )
        try:
            changes = await flat.start()
        except UplinkError as exc:
            raise DaemonError(str(exc)) from exc
        except OSError as exc:
            raise DaemonError(
                f"flatNetwork: cannot read or set the uplink's entries: {exc}"
            ) from exc
        log.info(
            "flat_network_started",
            uplink=flat.uplink.name if flat.uplink else None,
            added=len(changes.add),
            removed=len(changes.remove),
        )
        node.neighbours = flat
        self._spawn(flat.follow_forever(self.config.reconcile_interval_seconds), "flat-network")

    def _start_ip_pressure(self, node: NodeIPAM) -> None:
        """Kubernetes mode: the node's IP pressure as a condition and a taint
        (cns/node/ip_pressure.py) when `ipPressure.enabled`, else what an earlier daemon left
        of them removed."""
        if self._kube is None:
            return
        from cns.kube.node_pressure import NodeMarks
        from cns.node.ip_pressure import PressureReporter, clear

        marks = NodeMarks(self._kube, self.config.node_name)
        settings = self.config.ip_pressure
        if not settings.enabled:
            self._spawn(clear(marks), "ip-pressure-clear")  # ends once done: no stop
            return
        self._pressure = PressureReporter(
            node.lanes,
            marks,
            settings,
            on_change=lambda _, now: self._events.ip_pressure_changed(
                pressed=now.pressed, cause=str(now.cause or ""), subnets=list(now.lanes)
            ),
        )
        log.info(
            "ip_pressure_starting",
            enter_after_seconds=settings.enter_after_seconds,
            leave_free=settings.leave_free,
            leave_after_seconds=settings.leave_after_seconds,
        )
        self._spawn(self._pressure.run_forever(), "ip-pressure")

    def _start_leak_check(self, node: NodeIPAM) -> None:
        """Leak reclamation (cns/node/leak_reclaim.py): the runtime's sandboxes, and the node's
        pods when the daemon follows a cluster."""
        settings = self.config.leak_reclaim
        runtime = self._cri()
        assert runtime is not None
        pods = self._pods_on_node
        reclaimer = LeakReclaimer(node, runtime, pods, grace_seconds=settings.grace_seconds)
        log.info(
            "leak_check_starting",
            cri_socket=settings.cri_socket,
            check_seconds=settings.check_seconds,
            grace_seconds=settings.grace_seconds,
            pods="kubernetes" if pods is not None else None,
        )
        self._spawn(reclaimer.run_forever(settings.check_seconds), "leak-check")

    def _handle_signals(self, node: NodeIPAM) -> None:
        """Every signal whose default action would end the daemon, except SIGQUIT (core dump on
        purpose) and SIGKILL, does something documented instead (README, "Signals")."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._on_refresh_signal, node)
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            loop.add_signal_handler(sig, self._on_summary_signal, sig, node)

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        log.info("stop_signal_received", signal=sig.name, already=self.stop_requested.is_set())
        self.stop_requested.set()

    def _on_refresh_signal(self, node: NodeIPAM) -> None:
        source, read_config = self._standalone, self._read_config
        reserving = source is not None and read_config is not None
        actions = "reconcile,release-queue" + (",reserved-ips" if reserving else "")
        log.info("refresh_signal_received", signal="SIGHUP", actions=actions)
        if source is not None and read_config is not None:
            self._reserve_again(source, read_config)
        node.refresh()

    @staticmethod
    def _reserve_again(source: StandaloneSource, read_config: Callable[[], Config]) -> None:
        """A standalone node's `reservedIPs`, read again from the configuration file: a
        reservation added takes effect at once (no address of it granted again; held ones asked
        back, never taken from a pod). A file that cannot be read changes nothing; other
        settings need a restart."""
        try:
            config = read_config()
        except ConfigError as exc:
            log.error("config_reload_failed", error=str(exc), kept="the reservations in force")
            return
        source.reserve_again(config.standalone)

    def _on_summary_signal(self, sig: signal.Signals, node: NodeIPAM) -> None:
        connections = {site.cap.listener: site.cap.open for site in self._sites}
        log.info(
            "pool_summary", signal=sig.name, **views.summary(node), openConnections=connections
        )

    async def _until_stopped(self, waitable: object) -> None:
        assert asyncio.iscoroutine(waitable)
        task = asyncio.ensure_future(waitable)
        stop = asyncio.ensure_future(self.stop_requested.wait())
        crashed = list(self._tasks)
        running = {task, stop, *crashed}
        while True:  # a background task that ended without an error (its work done) is no stop
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            if {task, stop} & done or any(t.cancelled() or t.exception() is not None for t in done):
                break
        for t in (task, stop):
            t.cancel()
        for t in crashed:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise DaemonError(f"background task {t.get_name()} failed: {t.exception()!r}")

    def _spawn(self, coro: object, name: str) -> None:
        assert asyncio.iscoroutine(coro)
        self._tasks.append(asyncio.create_task(coro, name=name))

    async def _runner(self, app: web.Application, listener: str) -> web.AppRunner:
        runner = web.AppRunner(app, **listeners.runner_options(listener, SHUTDOWN_GRACE_SECONDS))
        await runner.setup()
        self._runners.append(runner)
        return runner

    async def _listen(
        self, runner: web.AppRunner, *, listener: str, address: tuple[str, int] | str, limit: int
    ) -> None:
        """Serve the runner's app on `address` through a CappedSite of at most `limit`
        connections."""
        cap = listeners.ConnectionCap(listener, limit)
        site = listeners.CappedSite(runner, address, cap)
        await site.start()
        self._sites.append(site)

    async def _listen_root_only(
        self, runner: web.AppRunner, *, listener: str, path: Path, limit: int
    ) -> None:
        """Serve on a unix socket only the daemon's user (root) can connect to: mode 0600 from
        the moment it exists; removed again at shutdown."""
        _claim_socket(path)
        old_umask = os.umask(0o177)
        try:
            await self._listen(runner, listener=listener, address=str(path), limit=limit)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        self._owned_sockets.append(path)

    async def _start_debug(self, node: NodeIPAM, caps: listeners.ConnectionCaps) -> None:
        """The debug endpoint on its root-only unix socket, which must work, and on debugListen;
        and the metrics listener on metrics.address, when set. Any local user may have bound
        either port first (a restart, an upgrade): then it is logged, reported (/healthz,
        /readyz, metrics) and tried again in the background, and cns serves pods all the same."""
        within_budget = debug.shared_budget()
        app = debug.build_app(node, self.metrics, self._serving, self._debug_port, within_budget)
        runner = await self._runner(app, "debug")
        path = self.config.debug_socket_path
        try:
            await self._listen_root_only(
                runner,
                listener="debug-socket",
                path=path,
                limit=listeners.DEBUG_SOCKET_MAX_CONNECTIONS,
            )
        except OSError as exc:
            raise DaemonError(f"cannot listen on debugSocketPath {path}: {exc}") from exc
        await self._listen_port(
            runner, self._debug_port, address=self.config.debug_host_port, limit=caps.debug
        )
        metrics_address = self.config.metrics.host_port
        if self._metrics_port is not None and metrics_address is not None:
            app = debug.build_metrics_app(self.metrics, within_budget)
            runner = await self._runner(app, "metrics")
            await self._listen_port(
                runner, self._metrics_port, address=metrics_address, limit=caps.metrics
            )

    async def _listen_port(
        self,
        runner: web.AppRunner,
        status: listeners.ListenerStatus,
        *,
        address: tuple[str, int],
        limit: int,
    ) -> None:
        """Listen on a port the daemon can do without; while it cannot, try again every
        DEBUG_LISTEN_RETRY_SECONDS in a task whose end stops nothing (it ends once it listens)."""
        if not await self._try_port(runner, status, address=address, limit=limit):
            self._port_retries.append(
                asyncio.create_task(
                    self._retry_port(runner, status, address=address, limit=limit),
                    name=f"{status.listener}-listen",
                )
            )

    async def _try_port(
        self,
        runner: web.AppRunner,
        status: listeners.ListenerStatus,
        *,
        address: tuple[str, int],
        limit: int,
    ) -> bool:
        try:
            await self._listen(runner, listener=status.listener, address=address, limit=limit)
        except OSError as exc:
            status.failures += 1
            if str(exc) != status.error:  # once per distinct failure, not every retry
                log.error(
                    f"{status.listener}_listen_failed",
                    address=status.address,
                    error=str(exc),
                    retry_seconds=DEBUG_LISTEN_RETRY_SECONDS,
                    debug_socket=str(self.config.debug_socket_path),
                )
            status.error = str(exc)
            return False
        if status.failures:
            log.info(
                f"{status.listener}_listen_serving",
                address=status.address,
                failures=status.failures,
            )
        status.serving, status.error = True, ""
        return True

    async def _retry_port(
        self,
        runner: web.AppRunner,
        status: listeners.ListenerStatus,
        *,
        address: tuple[str, int],
        limit: int,
    ) -> None:
        while True:
            await asyncio.sleep(DEBUG_LISTEN_RETRY_SECONDS)
            if await self._try_port(runner, status, address=address, limit=limit):
                return

    async def _start_socket(self, node: NodeIPAM, limit: int) -> None:
        app = api.build_app(
            node, self.attachments, self.metrics.observe_request, self._choose_subnets
        )
        runner = await self._runner(app, "socket")
        await self._listen_root_only(
            runner, listener="socket", path=self.config.socket_path, limit=limit
        )
        self._serving["socket"] = True

    async def _shutdown(self) -> None:
        notify("STOPPING=1")
        log.info("cns_stopping")
        self._serving.clear()
        for retry in self._port_retries:  # none may add a listener while they stop
            retry.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await retry
        for site in self._sites:  # every listener stops accepting before anything else
            await site.stop()
        if self._node is not None:
            self._node.stop_serving()
        # In flight: answered within the grace period, or closed. Every listener drains at once.
        cleanups = [runner.cleanup() for runner in self._runners]
        for failure in await asyncio.gather(*cleanups, return_exceptions=True):
            if failure is not None:
                log.error("listener_cleanup_failed", error=repr(failure))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._pressure is not None:  # before the API client closes
            await self._pressure.stop()
        with contextlib.suppress(Exception):
            await self.store.flush()
        self.store.close()
        if self._runtime is not None:
            await self._runtime.close()
        if self._kube is not None:
            await self._kube.close()
        for path in self._owned_sockets:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        log.info("cns_stopped")
