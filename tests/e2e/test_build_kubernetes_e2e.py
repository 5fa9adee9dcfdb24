"""scripts/build-kubernetes-e2e.sh on a stand-in cache: the source tree, Go and the binaries'
build are fakes with the real layout, so its progress, its cache and its check that the shared
source tree stays untouched are tested in seconds (the real build takes about 12 minutes)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# `go <test|build> -v -o OUT ...`: names a package, waits, writes OUT. FAKE_GO_TOUCH names a file
# it writes into the source tree (a build that is not clean).
FAKE_GO = """#!/bin/sh
while [ "$1" != -o ]; do shift; done
echo k8s.io/kubernetes/test/e2e/framework
sleep "${FAKE_GO_SECONDS:-0}"
[ -z "$FAKE_GO_TOUCH" ] || touch "$FAKE_GO_TOUCH"
printf '#!/bin/sh\\n' >"$2" && chmod +x "$2"
"""


def stand_in(tmp_path: Path) -> tuple[Path, Path]:
    """The scripts next to a no-op binaries' build, and a cache with source and a fake Go."""
    scripts = tmp_path / "repo" / "scripts"
    scripts.mkdir(parents=True)
    for name in ("setup.sh", "build-kubernetes-e2e.sh"):
        (scripts / name).write_text((REPO / "scripts" / name).read_text())
    (scripts / "build-kubernetes.sh").write_text("echo 'cached: bin'\n")
    cache = tmp_path / "cache"
    src = cache / "src" / "kubernetes-1.20.2"
    (src / "test" / "e2e").mkdir(parents=True)
    (src / ".go" / "src" / "k8s.io").mkdir(parents=True)
    (src / ".go" / "src" / "k8s.io" / "kubernetes").symlink_to("../../..")
    go = cache / "unpacked" / "usr" / "lib" / "go-1.19" / "bin" / "go"
    go.parent.mkdir(parents=True)
    go.write_text(FAKE_GO)
    go.chmod(0o755)
    return scripts / "build-kubernetes-e2e.sh", cache


def build(script: Path, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), str(cache)],
        env={**os.environ, "CNS_PROGRESS_SECONDS": "1", **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_builds_with_progress_then_is_quiet_when_cached(tmp_path: Path) -> None:
    script, cache = stand_in(tmp_path)
    result = build(script, cache, FAKE_GO_SECONDS="1.5")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "12 minutes" in lines[0] and "1.5 GB" in lines[0] and "build.log" in lines[0]
    progress = [line for line in lines if line.startswith("  still building (")]
    assert any(line.endswith("k8s.io/kubernetes/test/e2e/framework") for line in progress)
    bin_dir = cache / "e2e" / "bin"
    assert lines[-1] == f"built: e2e.test ginkgo agnhost in {bin_dir}"
    assert all(os.access(bin_dir / name, os.X_OK) for name in ("e2e.test", "ginkgo", "agnhost"))
    assert not list(bin_dir.glob("*.new"))

    again = build(script, cache)
    assert again.returncode == 0
    assert again.stdout == f"cached: {bin_dir}\n"


def test_a_build_that_writes_into_the_source_tree_fails_and_is_not_cached(
    tmp_path: Path,
) -> None:
    script, cache = stand_in(tmp_path)
    stray = cache / "src" / "kubernetes-1.20.2" / "test" / "e2e" / "generated.go"
    result = build(script, cache, FAKE_GO_TOUCH=str(stray))
    assert result.returncode == 1
    assert "changed the shared source tree" in result.stderr and str(stray) in result.stderr
    again = build(script, cache)  # built again, clean this time: the failed one was not cached
    assert again.returncode == 0, again.stdout + again.stderr
    assert not again.stdout.startswith("cached:")
