#!/usr/bin/env bash
# Turn a Debian rootfs (debootstrap-base.sh makes one) into a sandbox image
# whose boot mounts the four work folders and whose shutdown saves them.
#
#   packaging/sandbox-image/build-rootfs.sh ROOTFS --controller URL
#       [--user agent] [--home /home/USER] [--token-file PATH] [--token-from FILE]
#       [--wheelhouse DIR] [--source DIR]
#
# Run as root on the build host (needs systemd-nspawn, package systemd-container).
# In the image it:
#   - creates the agent user (default `agent`, home /home/agent);
#   - installs fsagent with packaging/install-fsagent.sh (venv in /opt/fsagent,
#     fsagent@.service, /etc/fsagent/fsagent.env);
#   - enables fsagent@task, fsagent@agent, fsagent@user and fsagent@project, so
#     every boot mounts $HOME/{task,agent,user,project} as the agent user and
#     every clean shutdown ships the final checkpoint of each;
#   - enables fsagent-repos.service (and fsagent-bridge.service), so every boot
#     prepares the task's repository checkouts in $HOME/repos as the agent user,
#     saves them every 180 s and once more at a clean shutdown (git comes with
#     the base rootfs, else install-fsagent.sh installs it);
#   - writes /etc/fsagent/agent.env (the folder variables an agent reads) and
#     /etc/profile.d/fsagent.sh, which exports them in the agent's login shell;
#   - makes sure the image meets the runtime contract `fsagent launch` and
#     `fsagent doctor` check: `node` on the PATH (the base rootfs has Debian's
#     nodejs; a rootfs without node gets it from Debian here, and the build
#     fails, naming what to do, where it cannot: put the owner's own node on
#     the image's PATH, e.g. /usr/local/bin, and build again), sh and tar.
# Only the files fsagent is built from are copied in (source-files.sh: the
# package, the units, the install script; never .demo/, demo-home/, a
# virtualenv, tokens or databases), and they are removed again at the end,
# also when the build fails.
# --token-file is where the run token is read from inside the image (default
# /etc/fsagent/run-token); whoever starts the sandbox puts the token there,
# owned by the agent user, mode 0400. --token-from FILE copies it in now.
# --wheelhouse DIR installs offline from wheels built on the host
# (`pip wheel --wheel-dir DIR .`, or the dependencies with setuptools and wheel
# to build this source tree in the image); without it pip in the image needs an index.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../env-quote.sh
. "$here/../env-quote.sh"
src="$(cd "$here/../.." && pwd)"
rootfs="" user=agent home="" controller="" token_file=/etc/fsagent/run-token
token_from="" wheelhouse=""
while (($#)); do
    case "$1" in
        --controller) controller="$2"; shift 2 ;;
        --user) user="$2"; shift 2 ;;
        --home) home="$2"; shift 2 ;;
        --token-file) token_file="$2"; shift 2 ;;
        --token-from) token_from="$2"; shift 2 ;;
        --wheelhouse) wheelhouse="$(cd "$2" && pwd)"; shift 2 ;;
        --source) src="$(cd "$2" && pwd)"; shift 2 ;;
        -*) echo "build-rootfs.sh: unknown argument $1" >&2; exit 2 ;;
        *) [[ -z "$rootfs" ]] || { echo "build-rootfs.sh: one ROOTFS only" >&2; exit 2; }
           rootfs="$1"; shift ;;
    esac
done
home="${home:-/home/$user}"
if [[ -z "$rootfs" || -z "$controller" ]]; then
    echo "usage: build-rootfs.sh ROOTFS --controller URL [options]" >&2
    exit 2
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "build-rootfs.sh: run as root" >&2
    exit 1
fi
rootfs="$(cd "$rootfs" && pwd)"
for f in usr/lib/systemd/systemd usr/bin/python3 usr/bin/fusermount3; do
    if [[ ! -e "$rootfs/$f" ]]; then
        echo "build-rootfs.sh: $rootfs has no /$f (make it with debootstrap-base.sh)" >&2
        exit 1
    fi
done
command -v systemd-nspawn >/dev/null || {
    echo "build-rootfs.sh: systemd-nspawn is missing (apt-get install systemd-container)" >&2
    exit 1
}

package=/var/tmp/fsagent-src
binds=()
pip_env=()
if [[ -n "$wheelhouse" ]]; then
    binds+=(--bind-ro="$wheelhouse:/run/fsagent-wheels")
    pip_env+=(--setenv=PIP_NO_INDEX=1 --setenv=PIP_FIND_LINKS=/run/fsagent-wheels)
    # A wheel of fsagent itself in there is installed; else the source tree is
    # built (the wheelhouse then needs the build backend: setuptools, wheel).
    for w in "$wheelhouse"/fsagent_workfolders-*.whl; do
        [[ ! -f "$w" ]] || package="/run/fsagent-wheels/${w##*/}"
    done
fi

stage="$rootfs/var/tmp/fsagent-src"  # the copy fsagent is built from

# Where PID 1 is not systemd, nspawn --keep-unit makes payload/ and supervisor/
# cgroups below its caller's and leaves them behind: give it a cgroup of its
# own (in each hierarchy) and remove that afterwards.
cgroups=()
if [[ ! -d /run/systemd/system ]]; then
    for h in systemd unified; do
        [[ -f /sys/fs/cgroup/$h/cgroup.procs ]] || continue
        if [[ $h == systemd ]]; then rel="$(sed -n 's/^[0-9]*:name=systemd://p' /proc/self/cgroup)"
        else rel="$(sed -n 's/^0:://p' /proc/self/cgroup)"; fi
        cgroups+=("/sys/fs/cgroup/$h${rel%/}/fsagent-image-$$")
    done
fi
remove_cgroups() {
    local d
    for d in "${cgroups[@]}"; do
        [[ -d "$d" ]] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
    done
}
clean_up() {
    rm -rf "$stage"
    remove_cgroups
}
trap clean_up EXIT

# What fsagent is built from goes in as a copy (pip builds in it), and only
# that (source-files.sh); it is removed at the end, whatever happens.
rm -rf "$stage"
mkdir -p "$stage"
"$here/source-files.sh" "$src" | tar -C "$src" --null --no-recursion -T - -cf - \
    | tar -C "$stage" -xf -

# One offline container run (no boot) does the work inside the image.
(
for d in "${cgroups[@]}"; do mkdir -p "$d" && echo "$BASHPID" >"$d/cgroup.procs"; done
exec systemd-nspawn --quiet --register=no --keep-unit --directory="$rootfs" \
    "${binds[@]}" "${pip_env[@]}" --setenv=DEBIAN_FRONTEND=noninteractive \
    /bin/bash -euo pipefail -c '
user="$1" home="$2" controller="$3" token_file="$4" package="$5"
id -u "$user" >/dev/null 2>&1 || useradd --create-home --home-dir "$home" \
    --user-group --shell /bin/bash "$user"
/var/tmp/fsagent-src/packaging/install-fsagent.sh --user "$user" --home "$home" \
    --controller "$controller" --token-file "$token_file" \
    --source /var/tmp/fsagent-src --package "$package"
install -d -o "$user" -g "$(id -gn "$user")" -m 0700 "$home/.local" "$home/.local/state"
units=(fsagent@task.service fsagent@agent.service fsagent@user.service fsagent@project.service)
# The local API endpoint and the repository checkouts, where this version of
# fsagent ships them.
for unit in fsagent-bridge.service fsagent-repos.service; do
    [[ ! -f "/etc/systemd/system/$unit" ]] || units+=("$unit")
done
command -v git >/dev/null || { echo "build-rootfs.sh: git is missing in the image" >&2; exit 1; }
# The runtime contract (node on the PATH, sh, tar), probed as fsagent
# launch probes it: a node the owner put in the image, else Debian nodejs.
if ! sh -c "command -v node" >/dev/null; then
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends nodejs; } >/dev/null \
        || true
fi
for cmd in node sh tar; do
    sh -c "command -v $cmd" >/dev/null || {
        echo "build-rootfs.sh: $cmd is not on the PATH of the image, which fsagent launch" \
            "and fsagent doctor require, and the Debian package could not be installed:" \
            "put your own $cmd on the PATH of the image (e.g. in /usr/local/bin) and build" \
            "again" >&2
        exit 1
    }
done
node --version >/dev/null || { echo "build-rootfs.sh: node in the image does not run" >&2; exit 1; }
systemctl enable "${units[@]}"
' build-rootfs "$user" "$home" "$controller" "$token_file" "$package"
)

agent_env="AGENT_HOME=$(env_quote "$home/agent")
PAPERCLIP_TASK_DIR=$(env_quote "$home/task")
PAPERCLIP_AGENT_DIR=$(env_quote "$home/agent")
PAPERCLIP_USER_DIR=$(env_quote "$home/user")
PAPERCLIP_PROJECT_DIR=$(env_quote "$home/project")"
printf '%s\n' "$agent_env" >"$rootfs/etc/fsagent/agent.env"
chmod 0644 "$rootfs/etc/fsagent/agent.env"
# The agent's variables in a login shell (profile-fsagent.sh), reading the env
# file fsagent-bridge.service writes in $home, named on the first line.
run_env="$(sh_quote "$home/.local/state/fsagent/env")"
{
    echo "fsagent_run_env=$run_env"
    cat "$here/profile-fsagent.sh"
} >"$rootfs/etc/profile.d/fsagent.sh"
chmod 0644 "$rootfs/etc/profile.d/fsagent.sh"

if [[ -n "$token_from" ]]; then
    install -D -m 0400 "$token_from" "$rootfs$token_file"
    uid="$(chroot "$rootfs" id -u "$user")" gid="$(chroot "$rootfs" id -g "$user")"
    chown "$uid:$gid" "$rootfs$token_file"
fi
echo "build-rootfs.sh: $rootfs is a sandbox image for $user ($home), controller $controller"
