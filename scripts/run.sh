#!/usr/bin/env bash
# Install cns and run the daemon in standalone mode, in the foreground (Ctrl-C stops it).
# Needs root on Debian: it installs RUN_PACKAGES (scripts/setup.sh: python3-venv, and the reference
# CNI plugins, iproute2 and iputils-ping for the README's quick tour) and binds /run/cns/cns.sock.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
install_system_packages "${RUN_PACKAGES[@]}"
install_python_env
exec .venv/bin/cns run --config config/cns.yaml "$@"
