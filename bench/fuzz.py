#!/usr/bin/env python3
"""Fuzzing `cns-ipam`, `cns-cni` and the socket API with hypothesis, against a real daemon.

Run (as root: `cns-cni` ADDs create veth pairs, in scratch network namespaces of this script):

    .venv/bin/python bench/fuzz.py --cases 10000 > fuzz.json
    .venv/bin/python bench/fuzz.py --targets api --cases 300     # one target, a quick look

Targets, each with its own fresh `cns run` daemon (standalone, state on disk):
- `ipam`: the installed `cns-ipam` executable (`cns install-cni`, the `python3 -IS` launcher), run
  with a generated network config on stdin (valid, mutated, random bytes, deep nesting, huge
  strings, wrong types, unknown cniVersions) and generated `CNI_*` variables (commands including
  garbage; container IDs, interface names, netns, CNI_ARGS and CNI_PATH with control characters,
  invalid UTF-8, over-long values, `../`; extra unknown CNI_ variables).
- `cni`: the installed `cns-cni` the same way; its CNI_NETNS is one of this script's scratch
  network namespaces (as is, or spelt with `..`, `//`, through a symlink) or something that is not
  a namespace (a FIFO, a regular file, a directory, /dev/null, a missing path, hostile strings),
  never a namespace of the host or of anybody else. Every successful ADD is undone with DEL.
- `api`: raw HTTP requests on the daemon's unix socket: methods, paths, HTTP versions, headers
  (Content-Length missing, wrong, duplicated; chunked bodies, good and broken; huge and non-ASCII
  headers), bodies (JSON objects around the documented fields with hostile values, random bytes,
  deep nesting, truncated JSON, bodies over the 1 MiB limit).

The daemon holds a few resident pods the whole time (two plain ADDs, two cns-cni attachments with
real veths), so that requests naming them (conflicts, CHECK/verify, DEL, GC) have something to
hit. Checked for every case:
- the answer is a CNI success or a CNI error object: for the plugins JSON on stdout with `code`
  (int) and `msg` (str), exit status 0 for success and 1 for an error, and nothing on stderr;
  code 102 (the plugin's catch-all for an unexpected exception) counts as a finding. For the API,
  a 2xx JSON object or a non-2xx JSON error with `code` and `msg`; aiohttp's plain-text 400 for
  malformed HTTP is the documented exception (docs/api.md), and a connection closed without a
  reply is accepted only when the request never completed (no end of head, or a body cut short);
- the daemon's log gains no traceback, no `api_internal_error`, nothing at error level, and no
  line longer than 4 KiB (a client's input copied into the log unbounded);
- the daemon is alive and its debug endpoint answers;
- on every answer that is not a success of a state-changing verb (so on every error, and on
  successful CHECK, STATUS, VERSION), `/debug/ips` is the same before and after: no IP changed
  owner or state. After a successful state change the script undoes it (DEL/detach of every
  non-resident owner, residents re-added) and takes a new baseline.

Some values are kept out on purpose, because the answer would depend on the client, not the
daemon: a client timeout below 5 s (the daemon may finish an ADD its client gave up on; a
runtime then DELs it), and a `releaseQueueDir` outside this script's directory (a DEL that cannot
reach the daemon writes there as root). The plugins always get an explicit `socket`: the default
`/run/cns/cns.sock` could be somebody else's daemon.

hypothesis runs with `derandomize=True` (the same cases on every run for the same hypothesis
version and --cases) and no example database; failures are recorded, not raised, so one finding
does not stop the run (and cases are not shrunk). Prints progress on stderr and one JSON report on
stdout; exits 1 if anything was found.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import BenchError, durable_temp_parent, exit_cleanly_on_sigterm, log, machine_facts
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cni_plugin.skel import COMMANDS, SUPPORTED_VERSIONS
from cns.host.datapath import host_ifname, host_link_exists
from tests.harness import REPO
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


class Strategies:
    """The strategies that name this run's scratch paths."""

    def harmless(self, value: object) -> bool:
        """False for a path that could be a network namespace that is not ours (the host's, a
        process's, another test's): a pod interface and a default route would land there."""
        if not isinstance(value, str) or "\0" in value:
            return True
        try:
            resolved = os.path.realpath(os.path.join(REPO, value))
        except (ValueError, OSError):
            return True
        if resolved.startswith("/proc"):
            return False
        ours = {f"/run/netns/{name}" for name in self.world.namespaces}
        return not resolved.startswith("/run/netns/") or resolved in ours

    def __init__(self, world: World) -> None:
        self.world = world
        scratch = world.netns_paths()
        name = world.namespaces[1]
        self.scratch_netns = weighted(
            (3, st.sampled_from(scratch)),
            (
                1,
                st.sampled_from(
                    [
                        f"/run/netns/{name}",
                        f"/var/run/netns/../netns/{name}",
                        f"/var/run/netns//{name}",
                        f"/var/run/netns/./{name}",
                    ]
                ),
            ),
        )
        special = world.special()
        self.not_a_netns = st.sampled_from(sorted(special.values()))
        self.netns = weighted(
            (60, self.scratch_netns),
            (20, self.not_a_netns),
            (4, st.just("")),
            (4, long_value("n", 4090, 5000)),
            (6, CONTROL),
            (6, st.text(alphabet="abcdefghij_-", min_size=1, max_size=20)),  # relative, missing
        ).filter(self.harmless)
        queue = world.queue_dir
        self.socket_values = weighted(
            (80, st.just(world.socket)),
            (
                8,
                st.sampled_from(
                    [
                        str(world.workdir / "missing.sock"),
                        str(world.workdir / "special"),
                        str(world.workdir / "special" / "file"),
                        str(world.workdir / "special" / "fifo"),
                        str(world.workdir / ("s" * 200)),
                        "relative.sock",
                    ]
                ),
            ),
            (6, JSON_SCALARS.filter(lambda v: not isinstance(v, str))),
            (3, st.just("")),
            (3, CONTROL),
        )
        self.queue_values = weighted(
            (80, st.just(queue)),
            (5, st.builds(lambda s: f"{queue}/{s}", st.text(alphabet="abc_.-", max_size=10))),
            (5, JSON_SCALARS.filter(lambda v: not isinstance(v, str))),
            (3, st.just("")),
            (3, st.just("relative-queue")),
            (4, CONTROL.map(lambda s: f"{queue}/{s}")),
        )
        self.timeouts = weighted(
            (6, st.just(15)),
            (2, st.floats(5, 30)),
            (2, st.sampled_from([0, -1, 1e308, "15", None, True, [], {}])),
        )

    # -- network configuration on stdin --

    def client_section(self, draw: st.DrawFn, type_: str) -> dict[str, Any]:
        section: dict[str, Any] = {"type": type_, "socket": draw(self.socket_values)}
        section["releaseQueueDir"] = draw(self.queue_values)
        if draw(st.booleans()):
            section["timeoutSeconds"] = draw(self.timeouts)
        return section

    def valid_config(self, draw: st.DrawFn, plugin: str, command: str) -> dict[str, Any]:
        version = draw(st.sampled_from([*SUPPORTED_VERSIONS, "1.1.0", "1.0.0"]))
        conf: dict[str, Any] = {"cniVersion": version, "name": draw(st.sampled_from(["fz", "n"]))}
        if plugin == "cns-ipam":
            conf["type"] = "bridge"
            conf["ipam"] = self.client_section(draw, "cns-ipam")
        else:
            conf.update(self.client_section(draw, "cns-cni"))
            if draw(st.booleans()):
                conf["mtu"] = draw(
                    st.one_of(st.integers(500, 9000), st.sampled_from([0, 70000, "1500", 1.5]))
                )
        if command == "CHECK" or draw(st.integers(0, 9)) == 0:
            ips = draw(
                st.one_of(
                    st.lists(
                        st.fixed_dictionaries(
                            {"address": st.sampled_from(["10.82.0.2/24", "10.82.0.3/32", "x"])}
                        ),
                        max_size=2,
                    ),
                    JSON_VALUES,
                )
            )
            conf["prevResult"] = draw(st.one_of(st.just({"ips": ips}), JSON_VALUES))
        if command == "GC" or draw(st.integers(0, 9)) == 0:
            attachment = st.fixed_dictionaries(
                {
                    "containerID": st.one_of(st.sampled_from(RESIDENT_IDS), UNICODE),
                    "ifname": IFNAMES,
                }
            )
            conf["cni.dev/valid-attachments"] = draw(
                st.one_of(st.lists(attachment, max_size=5), JSON_VALUES)
            )
        return conf

    def mutate(self, draw: st.DrawFn, conf: dict[str, Any]) -> dict[str, Any]:
        conf = json.loads(json.dumps(conf))
        for _ in range(draw(st.integers(1, 3))):
            target = conf
            if "ipam" in conf and isinstance(conf["ipam"], dict) and draw(st.booleans()):
                target = conf["ipam"]
            keys = sorted(target)
            action = draw(st.sampled_from(["drop", "retype", "add", "version", "huge"]))
            if action == "drop" and keys:
                key = draw(st.sampled_from(keys))
                if key not in ("socket", "releaseQueueDir"):  # see the module docstring
                    del target[key]
            elif action == "retype" and keys:
                key = draw(st.sampled_from(keys))
                if key not in ("socket", "releaseQueueDir", "timeoutSeconds"):
                    target[key] = draw(JSON_VALUES)
            elif action == "add":
                target[draw(UNICODE)] = draw(JSON_VALUES)
            elif action == "version":
                conf["cniVersion"] = draw(
                    st.one_of(
                        st.sampled_from(["0.1.0", "0.2.0", "1.2.0", "2.0.0", "1.1", "", "v1.0.0"]),
                        UNICODE,
                        JSON_SCALARS,
                    )
                )
            else:
                key = draw(st.sampled_from(["name", "zz-unknown", "type"]))
                target[key] = "x" * draw(st.integers(10_000, 1_000_000))
        return conf

    def stdin(self, draw: st.DrawFn, plugin: str, command: str) -> tuple[str, bytes]:
        kind = draw(
            st.sampled_from(
                ["valid"] * 10 + ["mutated"] * 5 + ["bytes", "bytes", "deep", "json", "json"]
            )
        )
        if kind == "bytes":
            return kind, draw(st.binary(max_size=2000))
        if kind == "deep":
            return kind, deep(draw(st.integers(1, 200_000)), draw(st.sampled_from(["list", "obj"])))
        if kind == "json":
            return kind, encode_json(draw(JSON_VALUES), draw(st.booleans()))
        conf = self.valid_config(draw, plugin, command)
        if kind == "mutated":
            conf = self.mutate(draw, conf)
        return kind, encode_json(conf, draw(st.booleans()))

    # -- the environment --

    def valid_env(self, draw: st.DrawFn, plugin: str) -> tuple[str, dict[bytes, bytes]]:
        """What a runtime passes: every variable well-formed."""
        command = draw(
            st.sampled_from(["ADD"] * 6 + ["DEL"] * 3 + ["CHECK"] * 3 + ["GC", "STATUS"])
        )
        pod = draw(st.sampled_from(["web-0", "db-0", "other"]))
        env = {
            b"CNI_COMMAND": command.encode(),
            b"CNI_CONTAINERID": draw(
                weighted((3, FUZZ_IDS), (1, VALID_ID)) | st.sampled_from(RESIDENT_IDS)
            ).encode(),
            b"CNI_IFNAME": draw(st.sampled_from(["eth0", "eth0", "eth1", "net1"])).encode(),
            b"CNI_NETNS": draw(self.scratch_netns).encode(),
            b"CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAME={pod};K8S_POD_NAMESPACE=shop".encode(),
            b"CNI_PATH": b"/opt/cni/bin",
        }
        return command, env

    def env(self, draw: st.DrawFn, plugin: str) -> tuple[str, str, dict[bytes, bytes]]:
        """(shape, command, environment): valid, valid with one hostile variable, or random."""
        shape = draw(st.sampled_from(["valid", "valid", "one hostile", "one hostile", "random"]))
        if shape != "random":
            command, env = self.valid_env(draw, plugin)
            if shape == "one hostile":
                _, hostile = self.random_env(draw, plugin)
                name = draw(st.sampled_from(sorted(hostile)))
                env[name] = hostile[name]
                if name == b"CNI_COMMAND":
                    command = hostile[name].decode("utf-8", "replace")
                    command = command if command in COMMANDS else ""
            return shape, command, env
        return shape, *self.random_env(draw, plugin)

    def random_env(self, draw: st.DrawFn, plugin: str) -> tuple[str, dict[bytes, bytes]]:
        command = draw(
            weighted(
                (85, st.sampled_from(["ADD"] * 7 + ["DEL"] * 3 + ["CHECK"] * 3 + ["GC", "STATUS"])),
                (10, st.sampled_from(["VERSION", "add", "ADD ", "", "DELETE"])),
                # No NUL: an environment cannot carry one (exec refuses it), nor can a runtime.
                (5, st.text(st.characters(exclude_characters="\0"), max_size=10)),
            )
        )
        env: dict[bytes, bytes] = {}
        if command or draw(st.booleans()):
            env[b"CNI_COMMAND"] = command.encode("utf-8", "surrogateescape")
        fields: dict[bytes, st.SearchStrategy[bytes]] = {
            b"CNI_CONTAINERID": env_bytes(
                weighted((8, CONTAINER_IDS), (1, HOSTILE_BYTES), (1, NO_NUL))
            ),
            b"CNI_IFNAME": env_bytes(weighted((8, IFNAMES), (1, HOSTILE_BYTES), (1, NO_NUL))),
            b"CNI_NETNS": env_bytes(self.netns)
            if plugin == "cns-cni"
            else env_bytes(
                weighted(
                    (7, self.netns),
                    (1, HOSTILE_BYTES),
                    (1, NO_NUL),
                    (1, long_value("n", 4000, 100_000)),
                )
            ),
            b"CNI_ARGS": cni_args(),
            b"CNI_PATH": env_bytes(
                weighted((8, st.just("/opt/cni/bin")), (1, HOSTILE_BYTES), (1, NO_NUL))
            ),
        }
        for name, strategy in fields.items():
            if draw(st.integers(0, 19)):  # each one missing now and then
                env[name] = draw(strategy)
        for _ in range(draw(st.integers(0, 2))):
            key = b"CNI_" + draw(st.text(alphabet="ABCXYZ_019", max_size=8)).encode()
            env.setdefault(key, draw(NO_NUL))
        decoded = command if command in COMMANDS else ""
        return decoded, env


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


def judge_plugin(command: str, done: subprocess.CompletedProcess[bytes]) -> Answer:
    problems = []
    if done.stderr:
        problems.append(f"stderr: {done.stderr[:300]!r}")
    if done.returncode not in (0, 1):
        problems.append(f"exit status {done.returncode}")
    out = done.stdout.strip()
    body: Any = None
    if out:
        try:
            body = json.loads(out)
        except ValueError:
            problems.append(f"stdout is not JSON: {out[:200]!r}")
    if done.returncode == 0:
        if command == "ADD":
            ips = body.get("ips") if isinstance(body, dict) else None
            if not isinstance(body, dict) or not isinstance(body.get("cniVersion"), str):
                problems.append(f"ADD result without cniVersion: {out[:200]!r}")
            elif not ips or not all(
                isinstance(ip, dict) and "/" in str(ip.get("address")) for ip in ips
            ):
                problems.append(f"ADD result without addresses: {out[:200]!r}")
        elif command == "VERSION":
            if not isinstance(body, dict) or "supportedVersions" not in body:
                problems.append(f"VERSION result malformed: {out[:200]!r}")
        elif out:
            problems.append(f"{command or 'no command'} succeeded with output: {out[:200]!r}")
        if command not in COMMANDS:
            problems.append("exit 0 without a valid CNI_COMMAND")
        return Answer(f"exit 0 {command}", True, command in MUTATING_COMMANDS, problems)
    problems += is_error_object(body)
    code = body.get("code") if isinstance(body, dict) else None
    if code == 102:
        problems.append(f"internal error in the plugin: {body}")
    return Answer(f"exit {done.returncode} code {code}", False, False, problems)


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
        if kind == "bytes":
            return kind, draw(st.binary(max_size=2000))
        if kind == "deep":
            return kind, deep(draw(st.integers(1, 200_000)), draw(st.sampled_from(["list", "obj"])))
        if kind == "json":
            return kind, encode_json(draw(JSON_VALUES), draw(st.booleans()))
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


def plugin_case(
    harness: Harness, plugin: Path, command: str, env: dict[bytes, bytes], stdin: bytes, kind: str
) -> None:
    stdin_kind, env_kind = kind.split("/")
    harness.target.inputs[f"stdin {stdin_kind}"] += 1
    harness.target.inputs[env_kind] += 1
    count_special_netns(harness, env.get(b"CNI_NETNS", b""), quoted=False)
    harness.target.inputs[f"command {command or 'garbage/none'}"] += 1
    try:
        done = subprocess.run(
            [str(plugin)],
            input=stdin,
            env=env,
            capture_output=True,
            cwd=harness.world.plugin_cwd,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        harness.judge(
            Answer("plugin hung", False, False, ["no exit within 60 s"]),
            describe(env=env, stdin=stdin),
        )
        return
    answer = judge_plugin(command, done)
    harness.judge(answer, describe(env=env, stdin=stdin, stdout=done.stdout))


def count_special_netns(harness: Harness, value: bytes, quoted: bool) -> None:
    """How often a case named one of the special paths: as CNI_NETNS (the whole value), or as a
    JSON string in a request (`quoted`)."""
    for what, path in harness.world.special().items():
        named = json.dumps(path).encode() in value if quoted else value == path.encode()
        if named:
            harness.target.inputs[f"netns: the {what}"] += 1


def run_plugin_target(harness: Harness, plugin: Path, strategies: Strategies, cases: int) -> None:
    name = plugin.name

    @st.composite
    def case(draw: st.DrawFn) -> tuple[str, dict[bytes, bytes], str, bytes]:
        shape, command, env = strategies.env(draw, name)
        kind, stdin = strategies.stdin(draw, name, command)
        return command, env, f"{kind}/env {shape}", stdin

    @settings(
        max_examples=cases,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case())
    def fuzz(drawn: tuple[str, dict[bytes, bytes], str, bytes]) -> None:
        command, env, kind, stdin = drawn
        plugin_case(harness, plugin, command, env, stdin, kind)
        progress(harness.target, cases)

    fuzz()


def run_api_target(harness: Harness, strategies: Strategies, cases: int) -> None:
    api = ApiStrategies(strategies)

    @settings(
        max_examples=cases,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
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


_last_progress = [0.0]


def progress(target: Target, cases: int) -> None:
    now = time.monotonic()
    if now - _last_progress[0] >= 30:
        _last_progress[0] = now
        found = sum(target.finding_kinds.values())
        log(f"{target.name}: {target.cases}/{cases} cases, findings {found}")


def install_plugins(workdir: Path) -> Path:
    bin_dir = workdir / "plugins" / "bin"
    subprocess.run(
        [sys.executable, "-m", "cns.commands.cli", "install-cni", "--bin-dir", str(bin_dir)],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    return bin_dir


def host_leftovers(names: set[str]) -> list[str]:
    """Host veths of this run's attachments that still exist."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    present = {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}
    return sorted(names & present)


def run_target(
    name: str, workdir: Path, bin_dir: Path, tag: str, cases: int
) -> tuple[Target, list[str]]:
    target = Target(name)
    world = World(
        workdir / name, f"{tag}{name[0]}", queue_dir=str(workdir / name / "queue"),
        plugin_cwd=str(workdir / name / "cwd"),
    )  # fmt: skip
    (workdir / name).mkdir()
    world.create()
    (workdir / name / "daemon").mkdir()
    harness = Harness(workdir / name / "daemon", world, target)
    leftovers: list[str] = []
    began = time.monotonic()
    try:
        harness.start()
        strategies = Strategies(world)
        if name == "api":
            run_api_target(harness, strategies, cases)
        else:
            run_plugin_target(harness, bin_dir / f"cns-{name}", strategies, cases)
        # Undo the residents too: every attachment of this run must be gone afterwards.
        for container, ifname, *_ in ATTACHED_RESIDENTS + PLAIN_RESIDENTS:
            harness.call("/v1/cni/detach", {"containerID": container, "ifName": ifname})
        assigned = [ip for ip in harness.daemon.ips() if ip["owner"]]
        if assigned:
            leftovers.append(f"still assigned after the undo: {assigned[:5]}")
    finally:
        target.seconds = time.monotonic() - began
        if harness.daemon.proc is not None:
            harness.daemon.stop()
        leftovers += world.destroy()
        leftovers += [f"host veth {v}" for v in host_leftovers(target.attachments_made)]
        queued = [
            *Path(world.queue_dir).glob("**/*.json"),
            *Path(world.plugin_cwd).glob("**/*.json"),
        ]
        target.inputs["DELs queued by a plugin (daemon unreachable)"] = len(queued)
    return target, leftovers


def report_of(target: Target, leftovers: list[str]) -> dict[str, Any]:
    return {
        "cases": target.cases,
        "seconds": round(target.seconds, 1),
        "answers": dict(target.answers.most_common()),
        "inputs": dict(target.inputs.most_common()),
        "stateChecks": target.state_checks,
        "successesUndone": target.undone,
        "daemonRestarts": target.restarts,
        "findings": dict(target.finding_kinds),
        "findingExamples": target.findings,
        "leftovers": leftovers,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=10_000, help="hypothesis examples per target")
    parser.add_argument("--targets", default="ipam,cni,api")
    parser.add_argument("--tmp-dir", help="parent of the temp dirs (default /var/tmp)")
    args = parser.parse_args(argv)
    args.targets = [t for t in args.targets.split(",") if t]
    if not set(args.targets) <= {"ipam", "cni", "api"}:
        parser.error("--targets: ipam, cni and/or api")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("fuzz: needs root (network namespaces for cns-cni)", file=sys.stderr)
        return 2
    exit_cleanly_on_sigterm()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    import hypothesis

    workdir = Path(tempfile.mkdtemp(prefix="cns-fuzz-", dir=durable_temp_parent(args.tmp_dir)))
    tag = f"cnsfz{os.getpid() % 10000}"
    load_before = os.getloadavg()
    began = time.monotonic()
    results: dict[str, Any] = {}
    failed = False
    try:
        bin_dir = install_plugins(workdir)
        facts = machine_facts(workdir)
        for name in args.targets:
            log(f"{name}: {args.cases} cases")
            target, leftovers = run_target(name, workdir, bin_dir, tag, args.cases)
            results[name] = report_of(target, leftovers)
            failed = failed or bool(target.finding_kinds) or bool(leftovers)
            log(f"{name}: done, {target.cases} cases, findings {dict(target.finding_kinds)}")
        report = {
            "benchmark": "fuzz",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": facts,
            "hypothesis": f"{hypothesis.__version__}, derandomize=True, database=None, "
            "phases=[generate]",
            "loadAverageBefore": [round(x, 2) for x in load_before],
            "loadAverageAfter": [round(x, 2) for x in os.getloadavg()],
            "minutes": round((time.monotonic() - began) / 60, 1),
            "targets": results,
        }
        print(json.dumps(report, indent=2))
        return 1 if failed else 0
    except BenchError as exc:
        print(f"fuzz: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
