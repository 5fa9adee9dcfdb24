"""Kubernetes' own e2e networking tests (`e2e.test` v1.20.2 under `ginkgo`) against a cluster of
this harness, offline.

The binaries come from scripts/build-kubernetes-e2e.sh, the images (agnhost, busybox, pause, all
named `localhost/e2e/...`) and the `KUBE_TEST_REPO_LIST` file that maps every registry of the
tests to that prefix from scripts/build-kubernetes-e2e-images.sh; `import_images` puts them into
a node's containerd. `run_e2e` runs the chosen specs and reads their junit reports.

Which specs: `[sig-network] Networking Granular Checks: Pods` and every other `[sig-network]`
`[Conformance]` spec, less those that need what the cluster has not: the internet, SCTP, a
disruption of the cluster, and cluster DNS (no CoreDNS source is reachable from this machine, so
Service names do not resolve in pods). `SKIPPED` names each skipped spec with its reason;
`SELECTION_SKIP` is the regular expression built from it.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

from tests.harness.containerd import Containerd
from tests.harness.kube_cluster import DEFAULT_CACHE

GRANULAR_CHECKS = r"\[sig-network\] Networking Granular Checks: Pods"
CONFORMANCE = r"\[sig-network\].*\[Conformance\]"
SELECTION_FOCUS = f"{GRANULAR_CHECKS}|{CONFORMANCE}"

# Reached through the Service's name (`nc <name> <port>` or `nslookup <name>` in a pod, in
# e2eservice.TestJig.CheckServiceReachability): needs cluster DNS.
_BY_SERVICE_NAME = "reaches the Service by its name (CheckServiceReachability): needs cluster DNS"
SKIPPED: dict[str, str] = {
    r"DNS": "cluster DNS (no CoreDNS source is reachable offline)",
    r"[Ss][Cc][Tt][Pp]": "SCTP: not built into this kernel's test namespaces, not a cns concern",
    r"Internet": "needs the internet",
    r"\[Disruptive\]": "restarts cluster components; not on a shared cluster",
    r"should be able to create a functioning NodePort service": _BY_SERVICE_NAME,
    r"should be able to change the type from ExternalName to ClusterIP": _BY_SERVICE_NAME,
    r"should be able to change the type from ExternalName to NodePort": _BY_SERVICE_NAME,
    r"should be able to change the type from ClusterIP to ExternalName": _BY_SERVICE_NAME,
    r"should be able to change the type from NodePort to ExternalName": _BY_SERVICE_NAME,
    r"session affinity": _BY_SERVICE_NAME,
}
SELECTION_SKIP = "|".join(SKIPPED)


def e2e_dir() -> Path:
    return Path(os.environ.get("CNS_KUBE_CACHE") or DEFAULT_CACHE) / "e2e"


def missing_e2e() -> list[str]:
    """What scripts/build-kubernetes-e2e.sh and build-kubernetes-e2e-images.sh must build."""
    wanted = [e2e_dir() / "bin" / name for name in ("e2e.test", "ginkgo")]
    wanted += [e2e_dir() / "images.tar", e2e_dir() / "repo-list.yaml"]
    return [str(path) for path in wanted if not path.exists()]


@dataclass(frozen=True)
class SpecResult:
    name: str
    outcome: str  # passed | failed | skipped
    seconds: float
    message: str = ""


@dataclass(frozen=True)
class E2EResult:
    specs: tuple[SpecResult, ...]
    returncode: int
    seconds: float
    log: Path

    def named(self, outcome: str) -> list[str]:
        return sorted(spec.name for spec in self.specs if spec.outcome == outcome)

    def ran(self) -> list[SpecResult]:
        return [spec for spec in self.specs if spec.outcome != "skipped"]

    def summary(self) -> str:
        failed = [spec for spec in self.specs if spec.outcome == "failed"]
        lines = [
            f"{len(self.named('passed'))} passed, {len(failed)} failed "
            f"in {self.seconds:.0f} s (log {self.log})"
        ]
        lines += [f"FAILED {spec.name}: {spec.message[:400]}" for spec in failed]
        return "\n".join(lines)


def import_images(containerd: Containerd) -> None:
    """The e2e images into a node's containerd (`k8s.io`, the kubelet's namespace)."""
    containerd.ctr("-n", "k8s.io", "images", "import", e2e_dir() / "images.tar", check=True)


def read_junit(report_dir: Path) -> list[SpecResult]:
    """Every spec of the junit files ginkgo wrote (one per parallel node)."""
    specs = []
    for path in sorted(report_dir.glob("junit_*.xml")):
        for case in ElementTree.parse(path).getroot().iter("testcase"):
            failure = case.find("failure")
            if failure is None:
                failure = case.find("error")
            if case.find("skipped") is not None:
                outcome = "skipped"
            elif failure is not None:
                outcome = "failed"
            else:
                outcome = "passed"
            message = "" if failure is None else (failure.get("message") or failure.text or "")
            name = case.get("name", "")
            specs.append(SpecResult(name, outcome, float(case.get("time", "0")), message))
    return specs


def run_e2e(
    *,
    kubeconfig: Path,
    kubectl: Path,
    report_dir: Path,
    focus: str = SELECTION_FOCUS,
    skip: str = SELECTION_SKIP,
    parallel: int = 2,
    timeout: float = 1800,
    dry_run: bool = False,
) -> E2EResult:
    """`ginkgo -nodes=<parallel> e2e.test -- ...` with the flags an offline local cluster needs
    (`--disable-log-dump`: otherwise the run ends by trying to ssh to the nodes)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    bin_dir = e2e_dir() / "bin"
    args = [
        str(bin_dir / "ginkgo"), f"-nodes={parallel}", "-noColor", f"-focus={focus}",
        f"-skip={skip}", *(["-dryRun"] if dry_run else []), str(bin_dir / "e2e.test"), "--",
        f"--kubeconfig={kubeconfig}", "--provider=local", f"--kubectl-path={kubectl}",
        "--minStartupPods=0", "--allowed-not-ready-nodes=0", "--node-os-distro=debian",
        "--disable-log-dump", f"--report-dir={report_dir}", "--ginkgo.noColor",
    ]  # fmt: skip
    env = {**os.environ, "KUBE_TEST_REPO_LIST": str(e2e_dir() / "repo-list.yaml")}
    log = report_dir / "e2e.log"
    started = time.monotonic()
    with log.open("w") as out:
        process = subprocess.run(
            args, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=report_dir
        )
    return E2EResult(
        specs=tuple(read_junit(report_dir)),
        returncode=process.returncode,
        seconds=time.monotonic() - started,
        log=log,
    )


def selected_specs(*, focus: str = SELECTION_FOCUS, skip: str = SELECTION_SKIP) -> list[str]:
    """The specs a selection runs, by a dry run of `e2e.test` (no cluster needed)."""
    output = subprocess.run(
        [str(e2e_dir() / "bin" / "e2e.test"), "--ginkgo.dryRun", "--ginkgo.noColor",
         "--ginkgo.v", f"--ginkgo.focus={focus}", f"--ginkgo.skip={skip}",
         "--kubeconfig=/dev/null", "--disable-log-dump", "--report-dir="],
        capture_output=True, text=True, timeout=120, cwd="/",
    ).stdout  # fmt: skip
    lines = output.splitlines()
    return sorted(
        f"{line.strip()} {lines[index + 1].strip()}"
        for index, line in enumerate(lines[:-1])
        if re.match(r"^\[(sig-network|k8s\.io)\]", line)
    )
