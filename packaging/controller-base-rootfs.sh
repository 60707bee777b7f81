#!/usr/bin/env bash
# Build a Debian rootfs to import as the base image of controller.Dockerfile
# where python:3.11-slim-bookworm cannot be pulled (no registry reachable,
# only a Debian mirror and the package index):
#
#   packaging/controller-base-rootfs.sh ROOTFS [SUITE [MIRROR]]
#   tar -C ROOTFS -c . | podman import \
#       --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
#       --change 'ENV LANG=C.UTF-8' - localhost/controller-base:bookworm
#   podman build -f packaging/controller.Dockerfile --format docker \
#       --ignorefile packaging/controller.Dockerfile.dockerignore --network host \
#       --build-arg PYTHON_IMAGE=localhost/controller-base:bookworm \
#       --build-arg PG_MAJOR=15 -t workfolders-controller .
#
# Run as root on a Debian host with debootstrap.  ROOTFS must not exist yet
# (an empty directory is fine).  It is minbase plus what the Dockerfile uses
# of a python image: python3 (bookworm's is 3.11), python3-venv, `python`
# (python-is-python3) and ca-certificates.  PG_MAJOR=15 is the PostgreSQL
# major bookworm has, so the client tools come from the same mirror.  SUITE
# defaults to bookworm, MIRROR to deb.debian.org.
set -euo pipefail

rootfs="${1:?usage: controller-base-rootfs.sh ROOTFS [SUITE [MIRROR]]}"
suite="${2:-bookworm}"
mirror="${3:-http://deb.debian.org/debian}"
packages=python3,python3-venv,python-is-python3,ca-certificates

if [[ $(id -u) -ne 0 ]]; then
    echo "controller-base-rootfs.sh: run as root" >&2
    exit 1
fi
if [[ -e "$rootfs" ]] && [[ -n "$(ls -A "$rootfs")" ]]; then
    echo "controller-base-rootfs.sh: $rootfs is not empty" >&2
    exit 1
fi
debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror"
# As in a slim image: no package lists or downloaded packages (every RUN of
# the Dockerfile starts with apt-get update), nothing of the build host's
# identity (the engine provides resolv.conf, hosts and hostname at run time).
find "$rootfs/var/cache/apt/archives" "$rootfs/var/lib/apt/lists" -maxdepth 1 -type f \
    ! -name lock -delete
rm -f "$rootfs/etc/resolv.conf" "$rootfs/etc/hostname"
