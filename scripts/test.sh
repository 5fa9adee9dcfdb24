#!/usr/bin/env bash
# Install everything and run the whole test suite: lint, types, unit, property, integration and
# end-to-end tests (these need root: network namespaces and the reference CNI plugins).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
install_system_packages python3-venv containernetworking-plugins iproute2 iputils-ping \
    hyperfine systemd openssl podman runc busybox-static containerd
install_python_env test
# A real kube-apiserver + etcd for the Kubernetes tests (built once, cached outside the repo).
bash scripts/build-kubernetes.sh >/tmp/cns-build-kubernetes.log 2>&1 \
    || { tail -40 /tmp/cns-build-kubernetes.log; exit 1; }
.venv/bin/ruff check cns cni_plugin tests bench
.venv/bin/mypy --strict cns cni_plugin
exec .venv/bin/pytest -p no:cacheprovider -q "$@"
