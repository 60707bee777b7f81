#!/usr/bin/env bash
# Install the Debian packages this project needs, only those that are missing.
#   packaging/install-deps.sh           runtime: FUSE, PostgreSQL server binaries, build tools,
#                                       git (fsagent repos, the demo's repository)
#   packaging/install-deps.sh --demo    also curl and Node.js, which the lines `make demo`
#                                       prints use inside the demo sandbox
#   packaging/install-deps.sh --test    also every program the tests run: curl (the demo's
#                                       printed lines), openssl (TLS certificates), systemd
#                                       (systemd-analyze, the environment.d generator),
#                                       util-linux and mount (unshare, nsenter, runuser,
#                                       mount), Chromium for the browser tests, npm for
#                                       axe-core, debootstrap and systemd-nspawn, podman
#                                       and runc (build and run the controller's image)
#   packaging/install-deps.sh --bench   also the FUSE peers bench.fsops compares with
#                                       (bindfs, rclone)
set -euo pipefail

pkgs=(fuse3 libfuse3-dev pkg-config gcc make python3 python3-dev python3-venv
      postgresql tar ca-certificates git)
# Packages wanted only for the commands they provide: a machine that already
# has the command from elsewhere (Node.js from NodeSource ships npm inside its
# nodejs package, which conflicts with Debian's npm) keeps it.
cmds=()
for opt in "$@"; do
    case "$opt" in
        # Chromium for the browser tests, npm for axe-core, debootstrap and
        # systemd-nspawn for the sandbox image boot test, podman (rootful:
        # conmon and crun come with it; runc runs containers where crun
        # refuses the host's cgroups; no uidmap, slirp4netns or fuse-overlayfs,
        # which only rootless needs) and debootstrap for the controller image
        # test, and the programs the other tests run (tests/system/test_ops_packaging.py
        # checks the list).
        --test) pkgs+=(chromium chromium-driver fonts-dejavu-core debootstrap systemd-container
                       systemd util-linux mount podman runc)
                cmds+=(nodejs:node npm:npm curl:curl openssl:openssl) ;;
        # The demo's curl lines, and node, which `fsagent launch` requires.
        --demo) cmds+=(curl:curl nodejs:node) ;;
        --bench) pkgs+=(bindfs rclone) ;;
        *) echo "usage: $0 [--demo] [--test] [--bench]" >&2; exit 2 ;;
    esac
done

missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
for pc in "${cmds[@]}"; do
    command -v "${pc#*:}" >/dev/null || missing+=("${pc%%:*}")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "missing Debian packages: ${missing[*]} (run this script as root)" >&2
        exit 1
    fi
    echo "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# udev makes /dev/fuse usable by every user (0666), which fusermount3 needs to
# mount for an unprivileged fsagent; machines booted without udev leave it 0600.
if [[ -c /dev/fuse && $(id -u) -eq 0 && $(stat -c %a /dev/fuse) != 666 ]]; then
    chmod 0666 /dev/fuse
fi
# The Debian postgresql package starts a system cluster; this project runs its
# own private clusters, so the system one is left alone (not stopped either).
exit 0
