#!/usr/bin/env bash
# Build real Kubernetes binaries offline from Debian's `kubernetes` source package (v1.20.2) with
# Debian's Go 1.19, and take etcd from Debian's etcd-server package. Only Debian's package
# registry is used; the system's apt configuration is left untouched (a private deb-src list is
# passed with -o options). The result is cached: re-running with the binaries present is a no-op.
#
#   scripts/build-kubernetes.sh [CACHE_DIR] [TARGET...]
#     CACHE_DIR defaults to $CNS_KUBE_CACHE or /var/cache/cns-kubernetes
#     TARGET    defaults to everything the tests run: kube-apiserver, kubelet, kube-scheduler,
#               kube-controller-manager, kubectl and kube-proxy (the multi-node cluster's)
#   -> CACHE_DIR/bin/<target name> and CACHE_DIR/bin/etcd
#
# Two known traps of building 1.20 with a newer Go, both fixed here:
# - the vendored github.com/modern-go/reflect2 v1.0.1 crashes under Go >= 1.18 on the first
#   custom-resource create ("fatal error: fault ... mapiterinit"); Debian's 1.0.2 is swapped in;
# - with Go >= 1.16 the vendored (kube-)openapi validators treat "" as null, so every empty string in
#   a custom resource is refused ("must be of type string: null"; kubernetes#99804, fixed
#   upstream in 1.21 by kube-openapi#230): its zero-value check is reduced to `data == nil`.
# BUILD_STAMP changes whenever the patches do, so a cache built without them is rebuilt.
BUILD_STAMP=3
set -euo pipefail
root=$(realpath -m "${1:-${CNS_KUBE_CACHE:-/var/cache/cns-kubernetes}}")
shift || true
targets=("$@")
((${#targets[@]})) || targets=(cmd/kube-apiserver cmd/kubelet cmd/kube-scheduler
                               cmd/kube-controller-manager cmd/kubectl cmd/kube-proxy)

have_all=1
for target in "${targets[@]}"; do [[ -x "$root/bin/${target##*/}" ]] || have_all=0; done
[[ -x "$root/bin/etcd" ]] || have_all=0
[[ "$(cat "$root/bin/.stamp" 2>/dev/null)" == "$BUILD_STAMP" ]] || have_all=0
if ((have_all)); then
    echo "cached: $root/bin"
    exit 0
fi

mkdir -p "$root"/{apt/lists/partial,apt/archives/partial,apt/sources.list.d,src,debs,unpacked,tools,bin,home}
apt_opts=(-o Dir::Etc::sourcelist=/dev/null -o "Dir::Etc::sourceparts=$root/apt/sources.list.d"
          -o "Dir::State::Lists=$root/apt/lists" -o "Dir::Cache::Archives=$root/apt/archives"
          -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=)

if [[ ! -e "$root/.fetched" ]]; then
    rm -rf "$root"/src/* "$root"/unpacked/*
    # deb-src twins of the machine's own apt sources (same mirror and suites).
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f "$f" ]] && sed 's/^Types:.*/Types: deb-src/' "$f" >"$root/apt/sources.list.d/${f##*/}"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f "$f" ]] && sed -n 's/^deb /deb-src /p' "$f" >"$root/apt/sources.list.d/${f##*/}.list"
    done
    apt-get "${apt_opts[@]}" update -qq
    (cd "$root/src" && apt-get "${apt_opts[@]}" source --download-only kubernetes \
        && tar xzf kubernetes_*.orig.tar.gz)
    (cd "$root/debs" && apt-get download golang-1.19-go golang-1.19-src etcd-server rsync \
        libpopt0 golang-github-modern-go-reflect2-dev)
    for deb in "$root"/debs/*.deb; do dpkg-deb -x "$deb" "$root/unpacked"; done
    # The build calls rsync; run Debian's without installing it system-wide.
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' \
        "$root/unpacked/usr/lib/x86_64-linux-gnu" "$root/unpacked/usr/bin/rsync" >"$root/tools/rsync"
    chmod +x "$root/tools/rsync"
    src=$(compgen -G "$root/src/kubernetes-*/" | head -1)
    rm -rf "${src}vendor/github.com/modern-go/reflect2"
    cp -r "$root/unpacked/usr/share/gocode/src/github.com/modern-go/reflect2" \
        "${src}vendor/github.com/modern-go/"
    touch "$root/.fetched"  # only now: an interrupted fetch starts over
fi

src=$(compgen -G "$root/src/kubernetes-*/" | head -1)
src=${src%/}
for validator in go-openapi/validate k8s.io/kube-openapi/pkg/validation/validate; do
    sed -i 's/if data == nil || reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data)) {/if data == nil {/' \
        "$src/vendor/${validator/#go-openapi/github.com/go-openapi}/type.go"
done
goroot="$root/unpacked/usr/lib/go-1.19"
mkdir -p "$src/.go/src/k8s.io"
ln -sfn ../../.. "$src/.go/src/k8s.io/kubernetes"
(cd "$src" && env GOROOT="$goroot" PATH="$goroot/bin:$root/tools:$PATH" GOPATH="$src/.go" \
    GOCACHE="$root/gocache" GOPROXY=off CGO_ENABLED=0 HOME="$root/home" \
    make WHAT="${targets[*]}")
for target in "${targets[@]}"; do cp "$src/_output/bin/${target##*/}" "$root/bin/"; done
cp "$root/unpacked/usr/bin/etcd" "$root/bin/"
echo "$BUILD_STAMP" >"$root/bin/.stamp"
echo "built: $(ls "$root/bin")"
