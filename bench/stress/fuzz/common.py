"""The fuzzer's shared parts: the scratch world the cases may name, the strategies every target
draws from, what an answer is, and the harness (a daemon with resident pods and the checks made
after every case)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from bench.benchlib import (
    BenchError,
    log,
)
from cns.host.datapath import host_ifname, host_link_exists
from tests.harness.daemon import Daemon

SUBNET = "10.82.0.0/24"
# This process's number is in every container ID the cases name: a host veth is named after its
# container ID and interface, so runs side by side (one per --targets) must not share IDs.
RUN = os.getpid() % 100_000
PLAIN_RESIDENTS = [
    (f"res{RUN}-0", "eth0", "web-0", "shop"),
    (f"res{RUN}-1", "eth0", "web-1", "shop"),
]
ATTACHED_RESIDENTS = [
    (f"res{RUN}-cni-0", "eth0", "db-0", "shop"),
    (f"res{RUN}-cni-1", "eth1", "db-1", "shop"),
]
RESIDENT_IDS = [r[0] for r in PLAIN_RESIDENTS + ATTACHED_RESIDENTS]
FUZZ_IDS = st.builds(lambda n: f"fz{RUN}-{n}", st.integers(0, 50))
API_PATHS = [
    "/v1/cni/add",
    "/v1/cni/del",
    "/v1/cni/check",
    "/v1/cni/gc",
    "/v1/cni/status",
    "/v1/cni/attach",
    "/v1/cni/detach",
    "/v1/cni/verify",
]
MUTATING_COMMANDS = {"ADD", "DEL", "GC"}
# One event per line with fields: a line this long carries a client's input unbounded.
MAX_LOG_LINE = 4096
LOG_MARKERS = ("Traceback", "api_internal_error", '"level": "error"', '"level": "critical"')


# --- the scratch world ------------------------------------------------------------------------


@dataclass
class World:
    """Paths the strategies may name: scratch namespaces and special files, all this script's."""

    workdir: Path
    tag: str
    namespaces: list[str] = field(default_factory=list)  # names under /run/netns
    socket: str = ""
    queue_dir: str = ""
    plugin_cwd: str = ""

    def netns_paths(self) -> list[str]:
        return [f"/var/run/netns/{name}" for name in self.namespaces]

    def special(self) -> dict[str, str]:
        return {
            "fifo": str(self.workdir / "special" / "fifo"),
            "file": str(self.workdir / "special" / "file"),
            "directory": str(self.workdir / "special"),
            "symlink to a scratch netns": str(self.workdir / "special" / "netns-link"),
            "missing": str(self.workdir / "special" / "missing"),
            "/dev/null": "/dev/null",
            "missing under /run/netns": f"/var/run/netns/{self.tag}-none",
        }

    def create(self) -> None:
        special = self.workdir / "special"
        special.mkdir()
        os.mkfifo(special / "fifo")
        (special / "file").write_text("not a namespace\n")
        for index in range(3):
            name = f"{self.tag}-{index}"
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
            self.namespaces.append(name)
        (special / "netns-link").symlink_to(self.netns_paths()[0])
        Path(self.queue_dir).mkdir(parents=True)
        Path(self.plugin_cwd).mkdir(parents=True)

    def destroy(self) -> list[str]:
        """Delete the namespaces; returns what was left in them (only `lo` is expected)."""
        leftovers = []
        for name in self.namespaces:
            links = subprocess.run(
                ["ip", "-netns", name, "-o", "link", "show"], capture_output=True, text=True
            ).stdout
            for line in links.splitlines():
                link = line.split(":")[1].strip().split("@")[0]
                if link != "lo":
                    leftovers.append(f"{name}: {link}")
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.namespaces.clear()
        return leftovers


# --- strategies -------------------------------------------------------------------------------

NO_NUL = st.binary(max_size=300).map(lambda b: b.replace(b"\0", b""))
CONTROL = st.text(alphabet=st.characters(max_codepoint=0x1F, exclude_characters="\0"), min_size=1)
UNICODE = st.text(max_size=40)
HOSTILE_BYTES = st.sampled_from(
    [
        b"\xff",
        b"\xed\xa0\x80",  # a UTF-16 surrogate encoded in UTF-8: invalid
        b"\xc3",  # truncated sequence
        b"../../etc/passwd",
        b".",
        b"..",
        b"a/b",
        b"a b",
        b"a\tb",
        b"a\nb",
        b"-leading-dash",
        b"\x1b[31mred",
        "\u00fc\u00fc\u00fc\u00fc\u00fc\u00fc\u00fc\u00fc\u00fc\u00fc\u00fc\u00fc\u00fc\u00fc\u00fc".encode(),
        b"%s%n%x",
        b"$(reboot)",
    ]
)


def fuzz_settings(cases: int) -> settings:
    """A target's hypothesis settings: `cases` generated examples, the same on every run (no
    database, no shrinking: a failure is reported as found), no deadline."""
    return settings(
        max_examples=cases,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


def long_value(char: str, low: int, high: int) -> st.SearchStrategy[str]:
    return st.integers(low, high).map(lambda n: char * n)


def weighted(*options: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of `options` with these weights: hypothesis' one_of picks branches about evenly and
    starts from the first, so most cases would be garbage the first check refuses."""
    total = sum(weight for weight, _ in options)

    def pick(n: int) -> st.SearchStrategy[Any]:
        for weight, strategy in options:
            if n < weight:
                return strategy
            n -= weight
        raise AssertionError(n)

    return st.integers(0, total - 1).flatmap(pick)


def env_bytes(values: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Strings become UTF-8 (lone surrogates through surrogateescape), bytes stay bytes."""

    def encode(value: str | bytes) -> bytes:
        if isinstance(value, bytes):
            return value.replace(b"\0", b"")
        return value.encode("utf-8", "surrogateescape").replace(b"\0", b"")

    return values.map(encode)


VALID_ID = st.from_regex(r"\A[a-zA-Z0-9][a-zA-Z0-9_.-]{0,30}\Z")
CONTAINER_IDS = weighted(
    (30, FUZZ_IDS),
    (15, st.sampled_from(RESIDENT_IDS)),
    (15, VALID_ID),
    (10, long_value("c", 1020, 1030)),
    (10, long_value("c", 1031, 100_000)),
    (10, UNICODE),
    (10, CONTROL),
)
IFNAMES = weighted(
    (50, st.sampled_from(["eth0", "eth0", "eth1", "net1", "lo"])),
    (15, st.text(alphabet="abcdefghijklmnop0123456789._-", min_size=1, max_size=15)),
    (5, long_value("e", 16, 300)),
    (10, st.sampled_from([".", "..", "a/b", "a:b", "a b", "eth0\n", "\u00fc" * 15, "\u00fc" * 8])),
    (10, UNICODE),
    (10, CONTROL),
)
POD_NAMES = weighted(
    (40, st.sampled_from(["web-0", "db-0", "other"])),
    (20, VALID_ID),
    (10, long_value("p", 250, 300)),
    (15, UNICODE),
    (15, CONTROL),
)


@st.composite
def cni_args(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["pods", "pods", "pods", "none", "garbage", "huge", "bytes"]))
    if kind == "none":
        return b""
    if kind == "garbage":
        return draw(st.sampled_from([b"a;b", b"=x", b";;;", b"K8S_POD_NAME", b"a=b=c"]))
    if kind == "huge":
        return b"IgnoreUnknown=1;K8S_POD_NAME=" + b"x" * draw(st.integers(1000, 100_000))
    if kind == "bytes":
        return draw(NO_NUL)
    parts = ["IgnoreUnknown=1"] if draw(st.booleans()) else []
    if draw(st.integers(0, 9)):
        parts.append(f"K8S_POD_NAME={draw(POD_NAMES)}")
    if draw(st.integers(0, 9)):
        parts.append(f"K8S_POD_NAMESPACE={draw(POD_NAMES)}")
    if draw(st.booleans()):
        parts.append(f"K8S_POD_UID={draw(UNICODE)}")
    return ";".join(parts).encode("utf-8", "surrogateescape").replace(b"\0", b"")


JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    UNICODE,
    CONTROL,
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(UNICODE, inner, max_size=4)
    ),
    max_leaves=12,
)


def deep(n: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * n + b"]" * n
    return b'{"a":' * n + b"1" + b"}" * n


def encode_json(value: Any, ascii_only: bool) -> bytes:
    """JSON bytes; lone surrogates become `\\ud800` escapes or invalid UTF-8 bytes."""
    text = json.dumps(value, ensure_ascii=ascii_only)
    return text.encode("utf-8", "surrogatepass")


def malformed_body(draw: st.DrawFn, kind: str) -> bytes | None:
    """The bodies every target is fed besides its own kinds: random bytes, nesting up to
    200,000 deep, any JSON value; None when `kind` is none of these."""
    if kind == "bytes":
        return draw(st.binary(max_size=2000))
    if kind == "deep":
        return deep(draw(st.integers(1, 200_000)), draw(st.sampled_from(["list", "obj"])))
    if kind == "json":
        return encode_json(draw(JSON_VALUES), draw(st.booleans()))
    return None


# --- one case: run it, judge the answer -------------------------------------------------------


@dataclass
class Answer:
    label: str  # for the tally: "exit 1 code 4", "http 200", ...
    success: bool
    mutating: bool  # a success that may have changed state on purpose
    problems: list[str] = field(default_factory=list)


def is_error_object(body: Any) -> list[str]:
    """Why `body` is not a CNI error object (`code` int, `msg` str, `details` str if present)."""
    if not isinstance(body, dict):
        return [f"error is not a JSON object: {str(body)[:200]}"]
    problems = []
    code = body.get("code")
    if not isinstance(code, int) or isinstance(code, bool):
        problems.append(f"error code is not an int: {code!r}")
    if not isinstance(body.get("msg"), str):
        problems.append("error msg is not a string")
    if "details" in body and not isinstance(body["details"], str):
        problems.append("error details is not a string")
    return problems


# --- the harness ------------------------------------------------------------------------------


def snapshot(ips: list[dict[str, Any]]) -> tuple[tuple[str, str, str], ...]:
    """What must not change on an error: each IP's state and owner."""
    return tuple(
        sorted((ip["address"], ip["state"], json.dumps(ip["owner"], sort_keys=True)) for ip in ips)
    )


@dataclass
class Target:
    name: str
    cases: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    inputs: Counter[str] = field(default_factory=Counter)
    findings: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # kind -> examples
    finding_kinds: Counter[str] = field(default_factory=Counter)
    state_checks: int = 0
    undone: int = 0
    restarts: int = 0
    seconds: float = 0.0
    attachments_made: set[str] = field(default_factory=set)  # host veth names


class Harness:
    """A daemon with resident pods, and the checks around every case."""

    def __init__(self, workdir: Path, world: World, target: Target) -> None:
        self.workdir = workdir
        self.world = world
        self.target = target
        self.daemon = Daemon(
            workdir,
            {
                "nodeName": f"fuzz-{target.name}",
                "scaler": {"batchSize": 16, "maxIPCount": 64},
                "standalone": {"subnet": SUBNET, "allocationLatencyMs": 0},
            },
        )
        world.socket = str(self.daemon.socket)
        self.log_offset = 0
        self.baseline: tuple[tuple[str, str, str], ...] = ()

    def start(self) -> None:
        self.daemon.start()
        self.restore()

    def call(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return self.daemon.call("POST", path, body)

    def restore(self) -> None:
        """Undo every non-resident owner, re-add missing residents, take a new baseline."""
        residents = {(r[0], r[1]): r for r in PLAIN_RESIDENTS + ATTACHED_RESIDENTS}
        held = set()
        for ip in self.daemon.ips():
            owner = ip["owner"]
            if not owner:
                continue
            key = (owner["containerID"], owner["ifName"])
            if key in residents:
                held.add(key)
                continue
            # Whatever it was (an ADD or an attach), detach takes its veth (if any) and its IP.
            status, body = self.call("/v1/cni/detach", {"containerID": key[0], "ifName": key[1]})
            if status != 200:
                raise BenchError(f"cannot undo {owner}: {status} {body}")
            self.target.undone += 1
            self.target.attachments_made.add(host_ifname(*key))
        for container, ifname, pod, namespace in PLAIN_RESIDENTS + ATTACHED_RESIDENTS:
            attached = (container, ifname, pod, namespace) in ATTACHED_RESIDENTS
            if (container, ifname) in held and (
                not attached or host_link_exists(container, ifname)
            ):
                continue
            body = {"containerID": container, "ifName": ifname, "podName": pod}
            body["podNamespace"] = namespace
            if attached:
                body["netns"] = self.world.netns_paths()[0]
                self.target.attachments_made.add(host_ifname(container, ifname))
            path = "/v1/cni/attach" if attached else "/v1/cni/add"
            status, reply = self.call(path, body)
            if status != 200:
                raise BenchError(f"cannot restore resident {container}: {status} {reply}")
        self.baseline = snapshot(self.daemon.ips())

    def new_log(self) -> str:
        with self.daemon.log_path.open("rb") as handle:
            handle.seek(self.log_offset)
            data = handle.read()
        self.log_offset += len(data)
        return data.decode("utf-8", "replace")

    def finding(self, kind: str, description: dict[str, Any], detail: str) -> None:
        self.target.finding_kinds[kind] += 1
        examples = self.target.findings.setdefault(kind, [])
        if len(examples) < 5:
            examples.append({"detail": detail[:600], **description})

    def judge(self, answer: Answer, description: dict[str, Any]) -> None:
        """Everything checked after a case, whatever the target."""
        target = self.target
        target.cases += 1
        target.answers[answer.label] += 1
        for problem in answer.problems:
            self.finding(f"invalid answer: {problem.split(':')[0][:50]}", description, problem)
        alive = self.daemon.proc is not None and self.daemon.proc.poll() is None
        try:
            ips = self.daemon.ips() if alive else None
        except (OSError, urllib.error.URLError, TimeoutError) as exc:
            ips = None
            self.finding("debug endpoint unresponsive", description, repr(exc))
        for line in self.new_log().splitlines():
            if any(marker in line for marker in LOG_MARKERS):
                self.finding("daemon log: error or traceback", description, line)
            if len(line) > MAX_LOG_LINE:
                self.finding(f"daemon log: line over {MAX_LOG_LINE} bytes", description, line)
        if ips is None:
            if not alive:
                self.finding("daemon died", description, self.daemon.log()[-600:])
            self.restart()
            return
        if answer.success and answer.mutating:
            self.restore()
            return
        target.state_checks += 1
        after = snapshot(ips)
        if after != self.baseline:
            changed = sorted(set(after) ^ set(self.baseline))[:6]
            self.finding(f"state changed on {answer.label}", description, repr(changed))
            self.restore()

    def restart(self) -> None:
        """After a hang or a crash: kill -9, start again (state is on disk), new baseline."""
        self.target.restarts += 1
        if self.daemon.proc is not None:
            self.daemon.proc.kill()
            self.daemon.proc.wait()
            self.daemon.proc = None
        self.daemon.start()
        self.new_log()
        self.restore()


def describe(**values: Any) -> dict[str, Any]:
    """A finding's reproduction, shortened: long values as their length and head."""

    def short(value: Any) -> Any:
        if isinstance(value, bytes | str) and len(value) > 200:
            return f"{value[:120]!r}... ({len(value)} long)"
        if isinstance(value, bytes):
            return repr(value)
        if isinstance(value, dict):
            return {short(k): short(v) for k, v in value.items()}
        return value

    return {k: short(v) for k, v in values.items()}


def count_special_netns(harness: Harness, value: bytes, quoted: bool) -> None:
    """How often a case named one of the special paths: as CNI_NETNS (the whole value), or as a
    JSON string in a request (`quoted`)."""
    for what, path in harness.world.special().items():
        named = json.dumps(path).encode() in value if quoted else value == path.encode()
        if named:
            harness.target.inputs[f"netns: the {what}"] += 1


_last_progress = [0.0]


def progress(target: Target, cases: int) -> None:
    now = time.monotonic()
    if now - _last_progress[0] >= 30:
        _last_progress[0] = now
        found = sum(target.finding_kinds.values())
        log(f"{target.name}: {target.cases}/{cases} cases, findings {found}")
