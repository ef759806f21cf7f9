#!/usr/bin/env bash
# Builds a Debian bookworm base image for the Dockerfile from Debian packages, for machines that
# cannot pull from an image registry: Python 3.11 with venv, and the shared libraries the wheels
# load (libnuma1, libibverbs1, libcurl4). Needs root and a Docker engine; installs debootstrap
# with apt where it is missing.
#   deploy/docker/base-image.sh [IMAGE]          (default rlmesh-base:bookworm)
#   docker compose build --build-arg BASE_IMAGE=rlmesh-base:bookworm   (or BASE_IMAGE=... in .env)
set -euo pipefail
image=${1:-rlmesh-base:bookworm}
# The mirror apt already uses on this host (deb822 or one-line sources), else Debian's CDN.
mirror=${DEBIAN_MIRROR:-$( (grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}';
                            grep -h '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}') | grep -v security | head -n1 || true)}
mirror=${mirror:-http://deb.debian.org/debian}
if ! command -v debootstrap > /dev/null; then
  apt-get update -qq > /dev/null && apt-get install -y -qq debootstrap > /dev/null
fi
rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" > "$rootfs.log" 2>&1 || { cat "$rootfs.log"; exit 1; }
chroot "$rootfs" apt-get install -y -qq --no-install-recommends python3 python3-venv libnuma1 libibverbs1 libcurl4 ca-certificates > /dev/null
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | docker import - "$image" > /dev/null
rm -f "$rootfs.log"
echo "$image"
