#!/usr/bin/env bash
# A real Kubernetes cluster with cns as its network (tests/harness/cluster_cli.py): one node on
# loopback, or --nodes N in namespaces of their own on one bridge (docs/cluster.md):
#   scripts/cluster.sh up [--dir DIR] [--subnet CIDR]   start it in the background
#   scripts/cluster.sh up --nodes 3 [--plugin ptp-cns-ipam] [--no-flat-network] [--dual-stack]
#                                                       three nodes on one bridge (docs/cluster.md)
#   scripts/cluster.sh down [--dir DIR] [--keep-logs]   stop it, put the host back as it was
# Needs root on Debian; installs what it needs (packages, venv, the cached Kubernetes build).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
if [[ "${1:-}" == "up" ]]; then
    install_system_packages "${TEST_PACKAGES[@]}"
stop_prometheus_services
    install_python_env test
    build_kubernetes
fi
exec .venv/bin/python -m tests.harness.cluster_cli "$@"
