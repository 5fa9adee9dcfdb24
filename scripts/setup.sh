# Shared by run.sh and test.sh: idempotent installation on a Debian machine.

install_system_packages() {
    local missing=()
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
            || missing+=("$pkg")
    done
    if ((${#missing[@]})); then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

install_python_env() {
    local extra="${1:-}"
    if [[ ! -x .venv/bin/python ]]; then
        /usr/bin/python3 -m venv .venv
    fi
    if [[ -n "$extra" ]]; then
        .venv/bin/pip install -q --disable-pip-version-check -e ".[$extra]"
    else
        .venv/bin/pip install -q --disable-pip-version-check -e .
    fi
}

# scripts/run.sh: the daemon's venv, and what the README's quick tour runs next to it (the
# reference `bridge` plugin, `ip netns`, `ping`).
RUN_PACKAGES=(python3-venv containernetworking-plugins iproute2 iputils-ping)

# Everything the tests and the local cluster (scripts/cluster.sh) need from Debian.
# mmdebstrap and systemd-container build and boot the Debian root of tests/e2e/test_systemd.py;
# e2fsprogs and util-linux give it mkfs.ext4 and fsfreeze; `file` checks that busybox is static
# for the e2e images (scripts/build-kubernetes-e2e-images.sh). prometheus brings promtool, which
# tests the alert rules (tests/unit/prometheus); its server is not started (a machine without
# systemd as PID 1, or stopped: stop_prometheus_services).
TEST_PACKAGES=("${RUN_PACKAGES[@]}" hyperfine systemd openssl podman runc busybox-static
               containerd iptables mmdebstrap systemd-container e2fsprogs util-linux file
               prometheus)

# The prometheus package starts its server and node exporter (and the exporter's timers) where
# systemd runs services; the tests need only promtool, and no server may stay on the host.
stop_prometheus_services() {
    if [[ -d /run/systemd/system ]]; then
        systemctl disable --now prometheus.service prometheus-node-exporter.service \
            'prometheus-node-exporter-*.timer' >/dev/null 2>&1 || true
    fi
}

# The Kubernetes binaries of the Kubernetes and node tests (scripts/build-kubernetes.sh): a no-op
# once cached; the first build is long and quiet, so a line every CNS_PROGRESS_SECONDS (30) says
# how long it has run and what it is doing.
build_kubernetes() {
    local cache=${CNS_KUBE_CACHE:-/var/cache/cns-kubernetes}
    local log=$cache/build.log every=${CNS_PROGRESS_SECONDS:-30}
    mkdir -p "$cache"
    echo "Kubernetes v1.20.2 binaries for the tests, cached in $cache (the first build takes" \
         "8-9 minutes on 2 cores and leaves about 3.8 GB there; log: $log)"
    : >"$log"
    report_progress "$log" "$every" "$$" &
    local reporter=$! status=0
    bash scripts/build-kubernetes.sh >"$log" 2>&1 || status=$?
    kill "$reporter" 2>/dev/null || true
    wait "$reporter" 2>/dev/null || true
    if ((status)); then
        tail -40 "$log"
        return "$status"
    fi
    echo "  $(tail -1 "$log")"
}

# Every $2 seconds while the shell $3 lives: the time since the start and the log's last line.
report_progress() {
    local log=$1 every=$2 owner=$3 started=$SECONDS
    while sleep "$every" </dev/null >/dev/null 2>&1 && kill -0 "$owner" 2>/dev/null; do
        local elapsed=$((SECONDS - started))
        printf '  still building (%dm%02ds): %s\n' $((elapsed / 60)) $((elapsed % 60)) \
            "$(tail -1 "$log" | cut -c1-100)"
    done
}
