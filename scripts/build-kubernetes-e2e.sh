#!/usr/bin/env bash
# Build Kubernetes' own end-to-end test binaries offline from the v1.20.2 source that
# scripts/build-kubernetes.sh caches, with the same Go 1.19 and in the same GOPATH way its
# `make WHAT=...` builds (hack/lib/init.sh sets GO111MODULE=off): e2e.test, ginkgo and a static
# agnhost (the server the networking tests run in their pods). The result is cached: re-running
# with the binaries present prints one line and does nothing else.
#
#   scripts/build-kubernetes-e2e.sh [CACHE_DIR]
#     CACHE_DIR defaults to $CNS_KUBE_CACHE or /var/cache/cns-kubernetes
#   -> CACHE_DIR/e2e/bin/{e2e.test,ginkgo,agnhost}, build log CACHE_DIR/e2e/build.log
#
# The source tree is shared by every test and by the other build: the outputs, the Go cache and
# the log stay outside it, and the build fails if anything in it is newer than its start.
# A line every CNS_PROGRESS_SECONDS (30) says how long the build has run and the log's last line
# (`go build -v` names packages as it compiles them; `go test -c` names none, so e2e.test shows
# its step only). e2e.test takes 6 to 12 minutes on 2 cores and leaves a 1.5 GB Go cache in
# CACHE_DIR/e2e/gocache; ginkgo and agnhost take seconds.
# E2E_STAMP changes whenever what is built changes, so an older cache is rebuilt.
E2E_STAMP=1
set -euo pipefail
here=$(dirname "$(realpath "$0")")
# shellcheck source=scripts/setup.sh
source "$here/setup.sh"
root=$(realpath -m "${1:-${CNS_KUBE_CACHE:-/var/cache/cns-kubernetes}}")
out=$root/e2e
products=(e2e.test ginkgo agnhost)

cached=1
for product in "${products[@]}"; do [[ -x "$out/bin/$product" ]] || cached=0; done
[[ "$(cat "$out/bin/.stamp" 2>/dev/null)" == "$E2E_STAMP" ]] || cached=0
if ((cached)); then
    echo "cached: $out/bin"
    exit 0
fi

# The source, Go and the GOPATH link come from the binaries' build (a no-op once cached). It
# rewrites vendored files, so it runs before this build's start is taken.
bash "$here/build-kubernetes.sh" "$root" >/dev/null
src=$(compgen -G "$root/src/kubernetes-*/" | head -1)
src=${src%/}
goroot=$root/unpacked/usr/lib/go-1.19
gopath_src=$src/.go/src/k8s.io/kubernetes
[[ -d "$gopath_src/test/e2e" && -x "$goroot/bin/go" ]] || {
    echo "no Kubernetes source with test/e2e or no Go under $root" >&2
    exit 1
}

mkdir -p "$out"/{bin,gocache,home}
log=$out/build.log
started=$out/.build-started
touch "$started"
: >"$log"
every=${CNS_PROGRESS_SECONDS:-30}
echo "Kubernetes v1.20.2 e2e.test, ginkgo and agnhost, cached in $out (the first build takes" \
     "6 to 12 minutes on 2 cores and leaves about 1.5 GB there; log: $log)"
report_progress "$log" "$every" "$$" &
reporter=$!
stop_reporter() { kill "$reporter" 2>/dev/null || true; wait "$reporter" 2>/dev/null || true; }
trap stop_reporter EXIT

version_pkgs=(k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version
              k8s.io/kubernetes/vendor/k8s.io/component-base/version)
ldflags="-s -w"
for pkg in "${version_pkgs[@]}"; do
    ldflags+=" -X $pkg.gitVersion=v1.20.2 -X $pkg.gitMajor=1 -X $pkg.gitMinor=20"
    ldflags+=" -X $pkg.gitTreeState=clean"
done

go_env=(GOROOT="$goroot" PATH="$goroot/bin:$PATH" GOPATH="$src/.go" GO111MODULE=off
        GOCACHE="$out/gocache" GOPROXY=off GOFLAGS= CGO_ENABLED=0 HOME="$out/home")
build() {
    local product=$1
    shift
    echo "+++ building $product" >>"$log"
    (cd "$gopath_src" && env "${go_env[@]}" go "$1" -v -o "$out/bin/$product.new" "${@:2}") >>"$log" 2>&1 \
        && mv "$out/bin/$product.new" "$out/bin/$product"
}
status=0
build e2e.test test -c -ldflags "$ldflags" ./test/e2e \
    && build ginkgo build -ldflags "-s -w" ./vendor/github.com/onsi/ginkgo/ginkgo \
    && build agnhost build -ldflags "-s -w" ./test/images/agnhost \
    || status=$?
stop_reporter
trap - EXIT
if ((status)); then
    tail -40 "$log"
    exit "$status"
fi

touched=$(find "$src" -newer "$started" -print | head -20)
if [[ -n "$touched" ]]; then
    echo "the build changed the shared source tree $src:" >&2
    echo "$touched" >&2
    exit 1
fi
echo "$E2E_STAMP" >"$out/bin/.stamp"
echo "built: ${products[*]} in $out/bin" | tee -a "$log"
