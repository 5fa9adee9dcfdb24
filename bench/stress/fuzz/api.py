"""The `api` target: raw HTTP requests on the daemon's unix socket, and their replies judged."""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from bench.stress.fuzz.common import (
    API_PATHS,
    CONTAINER_IDS,
    FUZZ_IDS,
    IFNAMES,
    JSON_SCALARS,
    JSON_VALUES,
    NO_NUL,
    POD_NAMES,
    RESIDENT_IDS,
    UNICODE,
    Answer,
    Harness,
    count_special_netns,
    describe,
    encode_json,
    fuzz_settings,
    is_error_object,
    long_value,
    malformed_body,
    progress,
    weighted,
)
from bench.stress.fuzz.plugins import Strategies


@dataclass
class RawRequest:
    data: bytes
    half_close: bool  # shut down the write side after sending (the request is all there is)
    complete: bool  # a whole request as far as HTTP framing goes
    path: str
    method: str


def read_reply(data: bytes) -> tuple[int, dict[str, str], bytes] | None:
    """(status, headers, body) of the final reply; interim `100 Continue` replies skipped."""
    while data.startswith(b"HTTP/1.1 100 "):
        data = data.partition(b"\r\n\r\n")[2]
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return None
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = headers.get("content-length")
    if length is not None and length.isdigit():
        body = body[: int(length)]
    return int(parts[1]), headers, body


def judge_api(request: RawRequest, reply: bytes) -> Answer:
    if not reply:
        problems = [] if not request.complete else ["closed without a reply to a whole request"]
        return Answer("no reply", False, False, problems)
    parsed = read_reply(reply)
    if parsed is None:
        return Answer("not HTTP", False, False, [f"reply is not HTTP: {reply[:200]!r}"])
    status, headers, body = parsed
    content_type = headers.get("content-type", "")
    if request.method == "HEAD":
        return Answer(f"http {status} (HEAD)", 200 <= status < 300, False, [])
    if status == 400 and content_type.startswith("text/plain"):
        return Answer("http 400 plain text (malformed HTTP)", False, False, [])
    try:
        decoded = json.loads(body)
    except ValueError:
        return Answer(f"http {status}", False, False, [f"body is not JSON: {body[:200]!r}"])
    if 200 <= status < 300:
        if not isinstance(decoded, dict):
            return Answer(f"http {status}", True, True, [f"2xx body not an object: {body[:100]!r}"])
        # By what was done, not by the path sent: aiohttp routes `/v1/cni/%61dd`, `...add?x=1`
        # and `http://cns/v1/cni/add` to ADD as well. ADD/attach reply with `ips`, DEL/GC/detach
        # with `released`; CHECK, verify and STATUS change nothing.
        mutating = "ips" in decoded or "released" in decoded
        route = request.path if request.path in API_PATHS else "another spelling of a path"
        return Answer(f"http {status} {route}", True, mutating, [])
    problems = is_error_object(decoded)
    code = decoded.get("code") if isinstance(decoded, dict) else None
    return Answer(f"http {status} code {code}", False, False, problems)


def reply_complete(data: bytes) -> bool:
    """A whole reply (head and Content-Length bytes of body) is in: stop reading, as the plugin
    does, rather than wait for a keep-alive connection to time out."""
    parsed = read_reply(data)
    if parsed is None:
        return False
    _, headers, body = parsed
    length = headers.get("content-length")
    return length is not None and length.isdigit() and len(body) >= int(length)


def exchange(path: str, request: RawRequest, timeout: float) -> bytes:
    """Send the request while reading the reply (the daemon may answer, and close, before it
    has read a large body). An incomplete request is followed by a half-close (the client gives
    up): the daemon would otherwise wait 5 s for the rest (408) on every such case. A complete
    one is not: the daemon closes a connection whose client half-closed without replying
    (aiohttp), and the plugins never half-close."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)

        def send() -> None:
            try:
                sock.sendall(request.data)
                if request.half_close:
                    sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the daemon closed early (e.g. a 400 for a bad head)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        reply = b""
        try:
            while not reply_complete(reply) and (chunk := sock.recv(65536)):
                reply += chunk
        except ConnectionResetError:
            pass
        sock.shutdown(socket.SHUT_RDWR)
        sender.join(timeout)
        return reply


class ApiStrategies:
    """Raw HTTP requests for the socket."""

    def __init__(self, strategies: Strategies) -> None:
        self.s = strategies
        value = st.one_of(CONTAINER_IDS, IFNAMES, POD_NAMES, JSON_VALUES, st.just(None)).filter(
            self.s.harmless
        )
        self.requests = st.composite(lambda draw: self.request(draw))()
        self.fields = {
            "containerID": weighted((9, CONTAINER_IDS), (1, value)),
            "ifName": weighted((9, IFNAMES), (1, value)),
            "netns": weighted((9, self.s.netns), (1, JSON_SCALARS.filter(self.s.harmless))),
            "podName": weighted((8, POD_NAMES), (2, value)),
            "podNamespace": weighted((8, POD_NAMES), (2, value)),
            "mtu": weighted((8, st.integers(500, 9100)), (2, JSON_SCALARS)),
            "ips": st.one_of(
                st.lists(st.sampled_from(["10.82.0.2/24", "10.82.0.3/32", "x"]), max_size=3),
                JSON_VALUES,
            ),
            "validAttachments": st.one_of(
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "containerID": st.one_of(st.sampled_from(RESIDENT_IDS), value),
                            "ifname": st.one_of(IFNAMES, value),
                        }
                    ),
                    max_size=5,
                ),
                JSON_VALUES,
            ),
        }

    def valid_body(self, draw: st.DrawFn, path: str) -> dict[str, Any]:
        """A request the daemon should serve: the fields its verb takes, well-formed."""
        key = {
            "containerID": draw(
                weighted(
                    (3, FUZZ_IDS),
                    (1, st.sampled_from(RESIDENT_IDS)),
                )
            ),
            "ifName": draw(st.sampled_from(["eth0", "eth0", "eth1", "net1"])),
        }
        if path == "/v1/cni/gc":
            return {
                "validAttachments": [{"containerID": c, "ifname": "eth0"} for c in RESIDENT_IDS]
            }
        body: dict[str, Any] = dict(key)
        if path in ("/v1/cni/add", "/v1/cni/attach"):
            body["podName"] = draw(st.sampled_from(["web-0", "db-0", "other"]))
            body["podNamespace"] = "shop"
        if path in ("/v1/cni/attach", "/v1/cni/verify") or draw(st.booleans()):
            body["netns"] = draw(self.s.scratch_netns)
        if path in ("/v1/cni/check", "/v1/cni/verify") and draw(st.booleans()):
            body["ips"] = [draw(st.sampled_from(["10.82.0.2/24", "10.82.0.3/32"]))]
        return body

    def body(self, draw: st.DrawFn, path: str) -> tuple[str, bytes]:
        kind = draw(
            st.sampled_from(
                ["fields"] * 14 + ["bytes", "deep", "truncated", "json", "empty", "huge"]
            )
        )
        malformed = malformed_body(draw, kind)
        if malformed is not None:
            return kind, malformed
        if kind == "empty":
            return kind, b""
        if kind == "huge":
            size = draw(st.sampled_from([(1 << 20) - 100, (1 << 20) + 1, 3 << 20]))
            return kind, b'{"containerID": "' + b"a" * size + b'", "ifName": "eth0"}'
        shape = draw(st.sampled_from(["valid", "one hostile", "one hostile", "random"]))
        if shape != "random":
            body = self.valid_body(draw, path)
            if shape == "one hostile":
                name = draw(st.sampled_from(sorted(self.fields)))
                body[name] = draw(self.fields[name])
            data = encode_json(body, draw(st.booleans()))
            if kind == "truncated":
                data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
                return kind, data
            return shape, data
        body = {}
        for name, strategy in self.fields.items():
            wanted = {
                "containerID": 9,
                "ifName": 9,
                "netns": 6 if path in ("/v1/cni/attach", "/v1/cni/verify") else 3,
                "validAttachments": 9 if path == "/v1/cni/gc" else 1,
            }.get(name, 3)
            if draw(st.integers(0, 9)) < wanted:
                body[name] = draw(strategy)
        if draw(st.integers(0, 9)) == 0:
            body[draw(UNICODE)] = draw(JSON_VALUES)
        data = encode_json(body, draw(st.booleans()))
        if kind == "truncated" or draw(st.integers(0, 19)) == 0:
            data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
            kind = "truncated"
        return kind, data

    def request(self, draw: st.DrawFn) -> tuple[str, RawRequest]:
        method = draw(
            weighted(
                (85, st.sampled_from(["POST"] * 12 + ["GET", "PUT", "DELETE", "HEAD", "OPTIONS"])),
                (10, st.sampled_from(["PATCH", "TRACE", "CONNECT", "BREW", "post", "P OST"])),
                (5, st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=10)),
            )
        )
        path = draw(
            weighted(
                (80, st.sampled_from(API_PATHS)),
                (
                    10,
                    st.sampled_from(
                        [
                            "/",
                            "/v1/cni/",
                            "/v2/cni/add",
                            "//v1/cni/add",
                            "/v1/cni/add/",
                            "/V1/CNI/ADD",
                            "/v1/cni/%61dd",
                            "/v1/cni/add?x=1",
                            "/v1/cni/../cni/add",
                            "/debug/ips",
                            "*",
                            "http://cns/v1/cni/add",
                        ]
                    ),
                ),
                (
                    5,
                    st.builds(
                        lambda s: f"/v1/cni/{s}", st.text(alphabet="abcdefgh%./-_", max_size=20)
                    ),
                ),
                (5, long_value("a", 1000, 20_000).map(lambda s: f"/v1/cni/{s}")),
            )
        )
        version = draw(
            weighted(
                (90, st.just("HTTP/1.1")),
                (
                    10,
                    st.sampled_from(["HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTP/1.1 x", "FOO", ""]),
                ),
            )
        )
        kind, body = self.body(draw, path)
        headers: list[tuple[bytes, bytes]] = [
            (b"Host", b"cns"),
            (b"Content-Type", b"application/json"),
            (b"Content-Length", str(len(body)).encode()),
            (b"Connection", b"close"),
        ]
        complete = True
        chunked = False
        mutation = draw(
            st.sampled_from(
                ["none"] * 30
                + ["no-length", "short-length", "long-length", "bad-length", "two-lengths"]
                + ["chunked", "broken-chunked", "expect", "huge-header", "bytes-header"]
                + ["no-colon", "many-headers", "keep-alive", "content-type", "fold"]
            )
        )
        if mutation == "no-length":
            headers = [h for h in headers if h[0] != b"Content-Length"]
        elif mutation == "short-length" and body:
            headers[2] = (b"Content-Length", str(draw(st.integers(0, len(body) - 1))).encode())
        elif mutation == "long-length":
            headers[2] = (b"Content-Length", str(len(body) + draw(st.integers(1, 5000))).encode())
            complete = False
        elif mutation == "bad-length":
            value = draw(st.sampled_from([b"-1", b"abc", b"1e3", b" 5", b"99999999999999999999"]))
            headers[2] = (b"Content-Length", value)
        elif mutation == "two-lengths":
            headers.append((b"Content-Length", str(len(body) + 1).encode()))
        elif mutation in ("chunked", "broken-chunked"):
            headers[2] = (b"Transfer-Encoding", b"chunked")
            chunked = True
        elif mutation == "expect":
            headers.append((b"Expect", b"100-continue"))
        elif mutation == "huge-header":
            headers.append((b"X-Big", b"h" * draw(st.integers(1000, 20_000))))
        elif mutation == "bytes-header":
            headers.append((b"X-Bytes", draw(NO_NUL).replace(b"\r", b"").replace(b"\n", b"")))
        elif mutation == "no-colon":
            headers.append((b"NoColonHere", b""))
        elif mutation == "many-headers":
            headers += [(f"X-H{i}".encode(), b"v") for i in range(draw(st.integers(50, 200)))]
        elif mutation == "keep-alive":
            headers[3] = (b"Connection", b"keep-alive")
        elif mutation == "content-type":
            value = draw(
                st.sampled_from([b"text/plain", b"", b"application/json; charset=latin-1"])
            )
            headers[1] = (b"Content-Type", value)
        elif mutation == "fold":
            headers.append((b"X-Fold", b"a\r\n b"))
        if chunked:
            if mutation == "chunked":
                payload = (f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n") if body else b""
                payload = payload or b"0\r\n\r\n"
            else:
                payload = b"zz\r\n" + body + b"\r\n"
                complete = False
        else:
            payload = body
        line = f"{method} {path} {version}".rstrip().encode()
        head = line + b"\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n"
        if kind == "truncated" and mutation in ("long-length", "no-length"):
            complete = False
        return f"{kind}/{mutation}", RawRequest(
            head + payload, half_close=not complete, complete=complete, path=path, method=method
        )


# --- the harness ------------------------------------------------------------------------------


def run_api_target(harness: Harness, strategies: Strategies, cases: int) -> None:
    api = ApiStrategies(strategies)

    @fuzz_settings(cases)
    @given(st.data())
    def fuzz(data: st.DataObject) -> None:
        kind, request = data.draw(api.requests)
        harness.target.inputs[kind.split("/")[0]] += 1
        count_special_netns(harness, request.data, quoted=True)
        harness.target.inputs[f"framing {kind.split('/')[1]}"] += 1
        try:
            reply = exchange(str(harness.daemon.socket), request, timeout=30)
        except (TimeoutError, OSError) as exc:
            harness.judge(
                Answer("no answer", False, False, [f"{type(exc).__name__}: {exc}"]),
                describe(request=request.data),
            )
            return
        harness.judge(judge_api(request, reply), describe(request=request.data, reply=reply))
        progress(harness.target, cases)

    fuzz()
