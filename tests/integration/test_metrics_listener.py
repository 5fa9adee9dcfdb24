"""The metrics listener (`metrics.address`): /metrics for Prometheus on another host, and nothing
else, while the debug endpoint stays on loopback (issue 28, item 2)."""

from __future__ import annotations

import http.client
import socket
import time
from typing import Any

from tests.harness.fleet import scrape
from tests.harness.ports import free_port


def request(port: int, method: str, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_the_metrics_listener_serves_get_metrics_and_nothing_else(make_daemon: Any) -> None:
    port = free_port()
    daemon = make_daemon({"metrics": {"address": "127.0.0.1", "port": port}})
    status, body = daemon.call(
        "POST", "/v1/cni/add", {"containerID": "secret-pod", "ifName": "eth0"}
    )
    assert status == 200, body

    status, text = request(port, "GET", "/metrics")
    assert status == 200
    scraped = scrape(port)
    assert scraped["cns_ready"] == 1
    assert scraped["cns_pool_ips{state=Assigned}"] == 1
    assert scraped[f"cns_listener_up{{address=127.0.0.1:{port},listener=metrics}}"] == 1
    assert scraped["cns_max_connections{listener=metrics}"] == 8
    assert b"secret-pod" not in text
    # The debug endpoint's views, its health and every other method are not served here.
    for path in ("/debug/pod?pod=default/x", "/debug/ips", "/debug/pool", "/healthz", "/readyz"):
        assert request(port, "GET", path)[0] == 404, path
    for method in ("POST", "PUT", "DELETE", "HEAD"):
        assert request(port, method, "/metrics")[0] == 405, method
    # The debug endpoint is where it was, with the same metrics.
    assert daemon.get("/debug/ips")["ips"][0]["owner"]["containerID"] == "secret-pod"
    assert "cns_ready 1.0" in daemon.get("/metrics")


def test_off_by_default(make_daemon: Any) -> None:
    daemon = make_daemon()
    assert not any("listener=metrics" in name for name in daemon.metrics())
    assert "metrics_listen" not in daemon.log()


def test_a_taken_metrics_port_stops_nothing_and_is_taken_once_free(make_daemon: Any) -> None:
    """Another process holds the port when cns starts: pods are served, the metric on the
    debug endpoint says so, and the listener serves once the port is free."""
    squatter = socket.create_server(("127.0.0.1", 0))
    port = squatter.getsockname()[1]
    daemon = make_daemon({"metrics": {"address": "127.0.0.1", "port": port}}, start=False)
    try:
        daemon.start()
        assert daemon.call("POST", "/v1/cni/add", {"containerID": "c1", "ifName": "eth0"})[0] == 200
        up = f'cns_listener_up{{address="127.0.0.1:{port}",listener="metrics"}}'
        assert daemon.metrics()[up] == 0
        assert '"metrics_listen_failed"' in daemon.log()
    finally:
        squatter.close()
    deadline = time.monotonic() + 30
    while daemon.metrics()[up] != 1:
        assert time.monotonic() < deadline, "the metrics port was not taken once free"
        time.sleep(0.2)
    assert request(port, "GET", "/metrics")[0] == 200
    assert daemon.stop() == 0
