#!/usr/bin/env bash
# Build a minimal Debian rootfs that build-rootfs.sh can turn into a sandbox image.
#
#   packaging/sandbox-image/debootstrap-base.sh ROOTFS [SUITE [MIRROR]]
#
# Run as root on a Debian host with debootstrap.  ROOTFS must not exist yet
# (an empty directory is fine).  The result boots under systemd (including
# `systemd-nspawn --boot`) and has what fsagent needs at run time: FUSE 3,
# Python 3 with venv, Git with an SSH client for the task's repository
# checkouts (`fsagent repos`, fsagent-repos.service), and Debian's Node.js
# (`node`, which the runtime contract requires on the PATH: `fsagent launch`
# refuses to start an agent without it and `fsagent doctor` fails; an owner
# who brings their own runtime puts it on the image's PATH instead).  SUITE defaults to bookworm (the host's Python ABI, so
# wheels built on the host install as they are), MIRROR to deb.debian.org.
set -euo pipefail

rootfs="${1:?usage: debootstrap-base.sh ROOTFS [SUITE [MIRROR]]}"
suite="${2:-bookworm}"
mirror="${3:-http://deb.debian.org/debian}"
packages=systemd,systemd-sysv,dbus,fuse3,python3,python3-venv,ca-certificates,git,openssh-client,nodejs

if [[ $(id -u) -ne 0 ]]; then
    echo "debootstrap-base.sh: run as root" >&2
    exit 1
fi
if [[ -e "$rootfs" ]] && [[ -n "$(ls -A "$rootfs")" ]]; then
    echo "debootstrap-base.sh: $rootfs is not empty" >&2
    exit 1
fi
debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror"
# Nothing from the build host's identity stays in the image.
rm -f "$rootfs/etc/machine-id" "$rootfs/var/lib/dbus/machine-id"
: >"$rootfs/etc/machine-id"
