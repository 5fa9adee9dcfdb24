"""The `ipam` and `cni` targets: the installed `cns-ipam` and `cns-cni` executables run with a
generated network config on stdin and generated `CNI_*` variables, and their answers judged."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from bench.stress.fuzz.common import (
    CONTAINER_IDS,
    CONTROL,
    FUZZ_IDS,
    HOSTILE_BYTES,
    IFNAMES,
    JSON_SCALARS,
    JSON_VALUES,
    MUTATING_COMMANDS,
    NO_NUL,
    RESIDENT_IDS,
    UNICODE,
    VALID_ID,
    Answer,
    Harness,
    World,
    cni_args,
    count_special_netns,
    describe,
    encode_json,
    env_bytes,
    fuzz_settings,
    is_error_object,
    long_value,
    malformed_body,
    progress,
    weighted,
)
from cni_plugin.skel import COMMANDS, SUPPORTED_VERSIONS
from tests.harness import REPO


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
        malformed = malformed_body(draw, kind)
        if malformed is not None:
            return kind, malformed
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


def run_plugin_target(harness: Harness, plugin: Path, strategies: Strategies, cases: int) -> None:
    name = plugin.name

    @st.composite
    def case(draw: st.DrawFn) -> tuple[str, dict[bytes, bytes], str, bytes]:
        shape, command, env = strategies.env(draw, name)
        kind, stdin = strategies.stdin(draw, name, command)
        return command, env, f"{kind}/env {shape}", stdin

    @fuzz_settings(cases)
    @given(case())
    def fuzz(drawn: tuple[str, dict[bytes, bytes], str, bytes]) -> None:
        command, env, kind, stdin = drawn
        plugin_case(harness, plugin, command, env, stdin, kind)
        progress(harness.target, cases)

    fuzz()
