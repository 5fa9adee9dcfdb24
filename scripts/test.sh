#!/usr/bin/env bash
# Install everything and run the whole test suite: lint, types, unit, property, integration and
# end-to-end tests (tests/unit, tests/integration, tests/e2e; the last two need root: network
# namespaces and the reference CNI plugins). Arguments go to pytest: `bash scripts/test.sh tests/unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
install_system_packages "${TEST_PACKAGES[@]}"
stop_prometheus_services
install_python_env test
# Real Kubernetes binaries (kube-apiserver, kubelet, scheduler, controller-manager, kubectl) and
# etcd for the Kubernetes and node tests: built once, cached outside the repo.
build_kubernetes
# Kubernetes' own e2e networking tests (tests/e2e/test_kubernetes_e2e.py): e2e.test, ginkgo and
# agnhost from the same source, and the images they run, built offline; cached the same way.
bash scripts/build-kubernetes-e2e.sh
bash scripts/build-kubernetes-e2e-images.sh
.venv/bin/ruff check cns cni_plugin tests bench
.venv/bin/mypy --strict cns cni_plugin
# The import contracts of pyproject.toml: layers, and the plugins' stdlib-only rule.
.venv/bin/lint-imports --no-cache
# The tests' temporary directories: removed when the run passes, kept (and named) when it fails.
basetemp=$(mktemp -d /tmp/cns-tests.XXXXXX)
status=0
# --durations: where the suite's time goes, at the end of every run.
pytest=(.venv/bin/pytest -p no:cacheprovider -q)
if (($# == 0)); then
    # The whole suite: the unit and property tests first, on every core (they share nothing:
    # no root, no namespace, no port); then the rest one at a time, as they share the host.
    "${pytest[@]}" -n auto --durations=10 --basetemp="$basetemp/unit" tests/unit || status=$?
    "${pytest[@]}" --durations=60 --basetemp="$basetemp/rest" --ignore=tests/unit || status=$?
else
    "${pytest[@]}" --durations=60 --basetemp="$basetemp" "$@" || status=$?
fi
if ((status == 0)); then
    rm -rf "$basetemp"
else
    echo "test directories kept for inspection: $basetemp"
fi
exit "$status"
