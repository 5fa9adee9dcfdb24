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

# Everything the tests and the local cluster (scripts/cluster.sh) need from Debian.
# mmdebstrap and systemd-container build and boot the Debian root of tests/test_systemd.py;
# e2fsprogs and util-linux give it mkfs.ext4 and fsfreeze.
TEST_PACKAGES=(python3-venv containernetworking-plugins iproute2 iputils-ping hyperfine systemd
               openssl podman runc busybox-static containerd iptables mmdebstrap
               systemd-container e2fsprogs util-linux)

build_kubernetes() {
    local cache=${CNS_KUBE_CACHE:-/var/cache/cns-kubernetes}
    mkdir -p "$cache"
    bash scripts/build-kubernetes.sh >"$cache/build.log" 2>&1 \
        || { tail -40 "$cache/build.log"; return 1; }
}
