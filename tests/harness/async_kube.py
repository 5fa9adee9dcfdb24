"""An asyncio client of the Kubernetes REST API for load generators: many requests in flight
from one process, and watches read line by line, with no thread per request.

`kube_api.KubeApi` is the synchronous client of the tests; this one exists because a benchmark
playing thousands of nodes must not spend a thread on each (bench/performance/controller_scale.py):

    async with AsyncKube(port=cluster.port, ca_file=cluster.ca_file, token=token) as kube:
        status, nnc = await kube.request("PATCH", path, patch, MERGE_PATCH)
        async for event in kube.watch(path, resource_version="0"):
            ...
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from tests.harness.kube_api import ApiError, Response

WATCH_SECONDS = 300


class AsyncKube:
    """One bearer-token user of one apiserver on loopback, at most `connections` requests on the
    wire at a time (the rest wait for a connection)."""

    def __init__(self, *, port: int, ca_file: Path, token: str, connections: int = 64) -> None:
        self.base = f"https://127.0.0.1:{port}"
        self._ssl = ssl.create_default_context(cafile=str(ca_file))
        self._headers = {"Authorization": f"Bearer {token}"}
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AsyncKube:
        connector = aiohttp.TCPConnector(limit=self._connections, ssl=self._ssl)
        self._session = aiohttp.ClientSession(
            connector=connector,
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use AsyncKube in `async with`")
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        *,
        timeout: float = 60.0,
    ) -> dict[str, Any]:
        """The JSON answer of a request; ApiError for a non-2xx answer."""
        data = None if body is None else json.dumps(body).encode()
        async with self.session.request(
            method,
            self.base + path,
            data=data,
            headers={"Content-Type": content_type},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as answer:
            raw = await answer.read()
        try:
            parsed: Any = json.loads(raw) if raw else {}
        except ValueError:
            parsed = raw.decode(errors="replace")
        response = Response(answer.status, dict(answer.headers), parsed, method, path)
        return response.raise_for_status().json

    async def watch(
        self, path: str, *, resource_version: str, seconds: int = WATCH_SECONDS
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch request from `resource_version`, bookmarks included, until
        the server ends it (after `seconds`). An ERROR event (410 Gone, for one) is yielded
        like any other: the caller decides to list again."""
        params = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(seconds),
        }
        async with self.session.get(
            self.base + path, params=params, timeout=aiohttp.ClientTimeout(total=seconds + 30)
        ) as answer:
            if answer.status != 200:
                raw = await answer.read()
                body = json.loads(raw) if raw.startswith(b"{") else raw.decode(errors="replace")
                raise ApiError(Response(answer.status, dict(answer.headers), body, "GET", path))
            # Lines are split here: aiohttp's readline refuses lines over 64 KiB, and the NNC of
            # a node holding many addresses is longer.
            pending = b""
            async for chunk in answer.content.iter_any():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)
