"""What every container config/ ships may do, pinned: a capability, a writable path, a host path
or a privilege added to a manifest fails here until this test and docs/kubernetes.md ("Least
privilege", where each grant has its reason and its measurement) say why. The same confinement is
checked on the real node, process by process, in tests/e2e/test_install_e2e.py."""

from __future__ import annotations

import re
from typing import Any

from cns.commands.install import SECCOMP_PROFILE_NAME
from tests.harness import REPO
from tests.harness.kube_api import load_manifests

CONFIG = REPO / "config"
# Measured on the real container (tests/e2e/test_install_e2e.py): an ADD fails without either of
# the first two; the flat-network mode's announcements without NET_RAW (tests/integration/
# test_flat_network.py).
DAEMON_CAPABILITIES = ["NET_ADMIN", "SYS_ADMIN", "NET_RAW"]
CONTROLLER_UID = 65532
# Where the kubelet reads Localhost seccomp profiles (<root-dir>/seccomp), the daemon's below it.
SECCOMP_DIR = "/var/lib/kubelet/seccomp/cns"


def _pod(manifest: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in load_manifests(CONFIG / manifest) if d["kind"] == kind]
    pod: dict[str, Any] = doc["spec"]["template"]["spec"]
    return pod


def _writable(container: dict[str, Any]) -> set[str]:
    return {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}


def test_the_daemonset_runs_unprivileged_with_its_two_capabilities_on_a_read_only_image() -> None:
    pod = _pod("daemonset.yaml", "DaemonSet")
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["hostNetwork"] is True  # it configures the host's network namespace
    assert not {"hostPID", "hostIPC"} & set(pod)
    volumes = {v["name"]: v for v in pod["volumes"]}
    host_paths = {v["hostPath"]["path"] for v in volumes.values() if "hostPath" in v}
    assert host_paths == {
        "/run/cns", "/var/lib/cns", "/opt/cni", "/etc/cni/net.d", "/run/containerd", "/run/netns",
        SECCOMP_DIR,
    }  # fmt: skip
    assert {kind for v in volumes.values() for kind in v if kind != "name"} == {
        "configMap", "hostPath", "emptyDir",
    }  # fmt: skip

    seccomp, init = pod["initContainers"]
    for container in (seccomp, init):
        assert container["securityContext"] == {
            "runAsUser": 0,
            "capabilities": {"drop": ["ALL"]},
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
        }
    assert seccomp["command"] == ["cns", "install-seccomp-profile", "--dir", SECCOMP_DIR]
    assert _writable(seccomp) == {SECCOMP_DIR}
    assert _writable(init) == {"/opt/cni", "/etc/cni/net.d"}

    (daemon,) = pod["containers"]
    assert daemon["securityContext"] == {
        "runAsUser": 0,
        "capabilities": {"drop": ["ALL"], "add": DAEMON_CAPABILITIES},
        "readOnlyRootFilesystem": True,
        # The profile install-seccomp-profile writes, relative to the kubelet's seccomp dir.
        "seccompProfile": {"type": "Localhost", "localhostProfile": f"cns/{SECCOMP_PROFILE_NAME}"},
    }
    assert SECCOMP_DIR not in {m["mountPath"] for m in daemon["volumeMounts"]}
    # Its state, its socket, the CNI files its hooks write, and a private /tmp (an emptyDir).
    assert _writable(daemon) == {"/var/lib/cns", "/run/cns", "/opt/cni", "/etc/cni/net.d", "/tmp"}
    tmp = next(m for m in daemon["volumeMounts"] if m["mountPath"] == "/tmp")
    assert "emptyDir" in volumes[tmp["name"]]


def test_the_daemon_holds_no_capability_the_systemd_unit_does_not() -> None:
    unit = (REPO / "systemd" / "cns.service").read_text()
    (bounding,) = re.findall(r"^CapabilityBoundingSet=(.*)$", unit, re.MULTILINE)
    assert {f"CAP_{name}" for name in DAEMON_CAPABILITIES} <= set(bounding.split())


def test_the_controller_runs_as_a_fixed_non_root_user_with_nothing() -> None:
    pod = _pod("controller.yaml", "Deployment")
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": CONTROLLER_UID,
        "runAsGroup": CONTROLLER_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert "volumes" not in pod
    assert not {"hostPID", "hostIPC"} & set(pod)
    (controller,) = pod["containers"]
    assert controller["securityContext"] == {
        "capabilities": {"drop": ["ALL"]},
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
    }
    assert "volumeMounts" not in controller
    # The image names that user and checks at build time that it can load the controller.
    containerfile = (REPO / "Containerfile").read_text()
    assert f"--uid {CONTROLLER_UID} --gid {CONTROLLER_UID}" in containerfile
    assert f"--reuid={CONTROLLER_UID} --regid={CONTROLLER_UID}" in containerfile
