"""Wiring of `cns controller`: credentials, the metrics listener, signals, and a clean hand-over.

On SIGTERM or SIGINT the controller stops and gives its lease up at once, so that a standby
takes over without waiting for the lease to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

import structlog
from aiohttp import web

from cns.controller.run import Controller
from cns.host import heap
from cns.kube.client import connect
from cns.kube.events import EventCollector, EventRecorder

log = structlog.get_logger("cns.controller")


async def run_controller(
    *,
    subnet: str,
    kubeconfig: str,
    namespace: str,
    identity: str,
    lease_seconds: int,
    metrics_listen: str,
    qps: float = 0,
    burst: int = 1,
) -> int:
    """Fulfil the NodeNetworkConfigs of every ClusterSubnet (of `subnet` only, if given) until
    SIGTERM/SIGINT; returns the exit code.
    Raises CredentialsError when `kubeconfig` (empty: in-cluster) cannot be loaded."""
    heap.fix_mmap_threshold()  # before the first list: the caches are tables of megabytes
    async with await connect(kubeconfig, qps=qps, burst=burst) as kube:
        recorder = EventRecorder(kube, component="cns-controller", host=identity)
        controller = Controller(
            kube,
            subnet_name=subnet,
            namespace=namespace,
            identity=identity,
            lease_seconds=lease_seconds,
            events=recorder,
        )
        recorder.host = controller.identity
        recorder.uid_of = controller.uid_of
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runner = None
        if metrics_listen:
            # prometheus_client only when asked
            from cns.web.controller_metrics import REGISTRY_KEY, build_app

            host, _, port = metrics_listen.rpartition(":")
            app = build_app(controller)
            app[REGISTRY_KEY].register(EventCollector(recorder, prefix="cns_controller"))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, host.strip("[]") or None, int(port)).start()
        running = asyncio.create_task(controller.run(), name="controller")
        writing = asyncio.create_task(recorder.write_forever(), name="events")
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([running, stopping], return_when=asyncio.FIRST_COMPLETED)
        running.cancel()
        stopping.cancel()
        writing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writing
        code = 0
        try:
            await running
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            log.error("controller_failed", error=repr(exc), identity=controller.identity)
            code = 1
        # Hand over at once: a standby need not wait for the lease to expire.
        await controller.elector.release()
        if runner is not None:
            await runner.cleanup()
        log.info("controller_stopped", identity=controller.identity)
    return code
