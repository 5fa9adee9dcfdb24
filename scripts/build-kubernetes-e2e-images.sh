#!/usr/bin/env bash
# The container images Kubernetes' networking e2e tests run, built offline (no registry is ever
# asked): agnhost 2.21 (the static agnhost of scripts/build-kubernetes-e2e.sh in a Debian
# bookworm minbase root with the tools its Dockerfile adds: curl, nc, ip, dig/nslookup), busybox
# 1.29 (Debian's busybox-static with its applet links) and pause 3.2 (the same busybox, sleeping).
# e2e.test finds them through KUBE_TEST_REPO_LIST=CACHE_DIR/e2e/repo-list.yaml, which maps every
# registry of test/utils/image/manifest.go to localhost/e2e (invalidRegistry stays invalid).
# Cached: re-running with the archive present (and newer than agnhost) prints one line and does
# nothing else.
#
#   scripts/build-kubernetes-e2e-images.sh [CACHE_DIR]
#     CACHE_DIR defaults to $CNS_KUBE_CACHE or /var/cache/cns-kubernetes
#   -> CACHE_DIR/e2e/images.tar (docker-archive of all three, for `ctr -n k8s.io images import`)
#      CACHE_DIR/e2e/repo-list.yaml
#
# podman runs on its own storage under a scratch directory: the host's images are untouched.
IMAGES_STAMP=1
set -euo pipefail
here=$(dirname "$(realpath "$0")")
root=$(realpath -m "${1:-${CNS_KUBE_CACHE:-/var/cache/cns-kubernetes}}")
out=$root/e2e
prefix=localhost/e2e
images=("$prefix/agnhost:2.21" "$prefix/busybox:1.29" "$prefix/pause:3.2")

if [[ -f "$out/images.tar" && -f "$out/repo-list.yaml" && ! "$out/bin/agnhost" -nt "$out/images.tar" \
      && "$(cat "$out/.images-stamp" 2>/dev/null)" == "$IMAGES_STAMP" ]]; then
    echo "cached: $out/images.tar"
    exit 0
fi

bash "$here/build-kubernetes-e2e.sh" "$root" >/dev/null
src=$(compgen -G "$root/src/kubernetes-*/" | head -1)
work=$(mktemp -d "$out/images-work.XXXXXX")
run=$(mktemp -d /tmp/cns-e2e-images.XXXXXX)  # podman refuses a runroot longer than 50 characters
podman_root=(--root "$work/storage" --runroot "$run/run" --tmpdir "$run/tmp"
             --storage-driver vfs --cgroup-manager cgroupfs --events-backend none)
cleanup() {
    if [[ -d "$work/storage" ]]; then
        podman "${podman_root[@]}" rmi -a -f >/dev/null 2>&1 || true
    fi
    rm -rf "$work" "$run"
}
trap cleanup EXIT

busybox_root() {
    local dir=$1 busybox=/bin/busybox
    mkdir -p "$dir"/{bin,etc,proc,sys,dev,tmp,root,run}
    cp "$busybox" "$dir/bin/busybox"
    for applet in $("$busybox" --list); do
        [[ "$applet" == busybox ]] || ln -sf busybox "$dir/bin/$applet"
    done
    printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' \
        >"$dir/etc/passwd"
    printf 'root:x:0:\nnobody:x:65534:\n' >"$dir/etc/group"
}
file /bin/busybox | grep -q "statically linked" || {
    echo "/bin/busybox is not static: install busybox-static" >&2
    exit 1
}

echo "e2e images: mmdebstrap bookworm for agnhost ..."
mmdebstrap --quiet --variant=minbase \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --include=curl,netcat-openbsd,iproute2,bind9-dnsutils,ca-certificates bookworm "$work/agnhost"
cp "$out/bin/agnhost" "$work/agnhost/agnhost"
ln -s agnhost "$work/agnhost/agnhost-2"
mkdir -p "$work/agnhost/uploads"
cp "$src/test/images/agnhost/porter/localhost.crt" "$src/test/images/agnhost/porter/localhost.key" \
    "$work/agnhost/"
busybox_root "$work/busybox"

import_image() {
    local dir=$1 image=$2
    shift 2
    tar -C "$dir" -cf "$work/rootfs.tar" .
    podman "${podman_root[@]}" import -q "$@" "$work/rootfs.tar" "$image" >/dev/null
    rm "$work/rootfs.tar"
}
import_image "$work/agnhost" "${images[0]}" --change 'ENTRYPOINT ["/agnhost"]' --change 'CMD ["pause"]'
import_image "$work/busybox" "${images[1]}" --change 'CMD ["/bin/sh"]'
import_image "$work/busybox" "${images[2]}" --change 'ENTRYPOINT ["/bin/sleep","2147483647"]'
podman "${podman_root[@]}" save -q --format docker-archive -m -o "$work/images.tar" "${images[@]}"
mv "$work/images.tar" "$out/images.tar"

{
    echo "# KUBE_TEST_REPO_LIST for e2e.test v1.20.2: every registry is $prefix."
    for key in gcAuthenticatedRegistry dockerLibraryRegistry dockerGluster e2eRegistry \
               e2eVolumeRegistry promoterE2eRegistry buildImageRegistry gcRegistry \
               sigStorageRegistry gcrReleaseRegistry privateRegistry sampleRegistry; do
        echo "$key: $prefix"
    done
} >"$out/repo-list.yaml"
echo "$IMAGES_STAMP" >"$out/.images-stamp"
echo "built: $out/images.tar (${images[*]}), $out/repo-list.yaml"
