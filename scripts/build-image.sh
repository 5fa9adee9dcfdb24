#!/usr/bin/env bash
# `make image`: the cns container image, built offline (no registry: see Containerfile).
#   scripts/build-image.sh            build localhost/cns:<tag>, print the name and its size
#   scripts/build-image.sh --tag      print the tag only (what the build would produce)
#   scripts/build-image.sh --save F   also write the image as an archive (for `ctr images import`)
# It is tagged localhost/cns:<version> too, the tag config/kustomization.yaml sets.
# The tag is <version>-<hash of the image's inputs> (Containerfile, pyproject.toml, README.md,
# cns/, cni_plugin/ as they are in the work tree): the same checkout gives the same tag, any change
# a new one, so a DaemonSet's rolling update is a change of tag. The two Debian bases are built
# once by mmdebstrap and cached in CNS_IMAGE_CACHE (/var/cache/cns-image). The build itself runs
# without a network: its context is the wheels the host's pip builds and fetches (with the host's
# pip configuration: indexes, certificates, constraints).
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${CNS_IMAGE_CACHE:-/var/cache/cns-image}
suite=bookworm
inputs=(Containerfile pyproject.toml README.md cns cni_plugin)

image_tag() {
    local version hash
    version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
    hash=$(git ls-files -z -- "${inputs[@]}" | LC_ALL=C sort -z \
        | xargs -0 sha256sum | sha256sum | cut -c1-12)
    echo "$version-$hash"
}

# A Debian root as a podman image: mmdebstrap writes the tarball once, podman imports it.
base_image() {
    local name=$1 packages=$2 tarball=$cache/$1.tar
    if [[ ! -s $tarball ]]; then
        echo "==> mmdebstrap $suite ($packages) -> $tarball (once; about 30 s)"
        mkdir -p "$cache"
        SOURCE_DATE_EPOCH=0 mmdebstrap --quiet --format=tar --variant=minbase --include="$packages" \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
            --dpkgopt='path-exclude=/usr/share/locale/*' \
            "$suite" "$tarball.part"
        mv "$tarball.part" "$tarball"
    fi
    if ! podman image exists "localhost/cns-base:$name"; then
        echo "==> podman import $tarball -> localhost/cns-base:$name"
        podman import --quiet "$tarball" "localhost/cns-base:$name" >/dev/null
    fi
}

tag=$(image_tag)
if [[ ${1:-} == --tag ]]; then
    echo "$tag"
    exit 0
fi
image=localhost/cns:$tag
base_image "$suite" python3
base_image "$suite-build" python3,python3-venv
if podman image exists "$image"; then
    echo "==> $image exists (same inputs)"
else
    context=$(mktemp -d)
    trap 'rm -rf "$context"' EXIT
    echo "==> wheels: cns from the tracked files of ${inputs[*]}, its dependencies (host's pip)"
    mkdir "$context/src"
    git ls-files -z -- "${inputs[@]}" | xargs -0 cp --parents -t "$context/src"
    /usr/bin/python3 -m venv "$context/pip"
    "$context/pip/bin/pip" wheel --quiet --disable-pip-version-check --only-binary=:all: \
        --wheel-dir "$context/wheels" "$context/src" 2>&1 | { grep -v " is ignored: " || true; }
    rm -rf "$context/pip" "$context/src"
    cp Containerfile "$context/"
    echo "==> podman build -t $image (no network)"
    podman build --quiet --network=none -t "$image" -f Containerfile "$context" >/dev/null
fi
version_tag=localhost/cns:${tag%-*}
podman tag "$image" "$version_tag"   # what config/kustomization.yaml names
size=$(podman image inspect --format '{{.Size}}' "$image")
echo "==> $image (also $version_tag): $((size / 1000000)) MB ($size bytes)"
if [[ ${1:-} == --save ]]; then
    echo "==> podman save -> $2"
    rm -f "$2"
    podman save --quiet -o "$2" "$image"
fi
