#!/usr/bin/env bash
# Build a local Debian bookworm base image with python3, venv and pip, from the Debian mirror
# (debootstrap + podman import), for hosts that cannot pull python:3.12-slim-bookworm.
#
#   docker/image/build_base.sh            # -> localhost/servelm-base:bookworm (skipped if it exists)
#
# Installs podman, runc and debootstrap with apt-get when they are missing (needs root).
# Environment: BASE_IMAGE (tag), DEBIAN_MIRROR, DEBIAN_SUITE, FORCE=1 to rebuild.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
BASE_IMAGE=${BASE_IMAGE:-localhost/servelm-base:bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$HERE/containers.conf}

need=()
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v curl >/dev/null || need+=(curl)  # image_check.sh probes the server with it
if ((${#need[@]})); then
    if [[ $(id -u) != 0 ]]; then
        echo "build_base: missing ${need[*]}; install them as root (apt-get install ${need[*]})" >&2
        exit 1
    fi
    echo "build_base: installing ${need[*]}"
    apt-get update -q
    # With podman's recommends (slirp4netns, fuse-overlayfs, uidmap, ...) and iptables for -p, as tried
    # by hand on this kind of host.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" ca-certificates iptables
fi

if [[ ${FORCE:-0} != 1 ]] && podman image exists "$BASE_IMAGE"; then
    echo "build_base: $BASE_IMAGE exists (FORCE=1 rebuilds)"
    exit 0
fi

rootfs=$(mktemp -d /var/tmp/servelm-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
start=$(date +%s)
echo "build_base: debootstrap $DEBIAN_SUITE from $DEBIAN_MIRROR into $rootfs"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    "$DEBIAN_SUITE" "$rootfs" "$DEBIAN_MIRROR"
# Smaller image: no package lists, caches or docs (apt-get update in the Dockerfile fetches lists).
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
tar -C "$rootfs" -c . | podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE"
echo "build_base: $BASE_IMAGE built in $(( $(date +%s) - start )) s"
podman image ls "$BASE_IMAGE"
