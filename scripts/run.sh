#!/usr/bin/env bash
# Install cns and run the daemon in standalone mode, in the foreground (Ctrl-C stops it).
# Needs root on Debian: it installs python3-venv and binds /run/cns/cns.sock.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
install_system_packages python3-venv
install_python_env
exec .venv/bin/cns run --config config/cns.yaml "$@"
