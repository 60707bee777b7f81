#!/usr/bin/env bash
# Install fsagent into a virtualenv under /opt/fsagent with its systemd units:
# the fsagent@.service template (one mount per collection),
# fsagent-bridge.service (the local API endpoint) and fsagent-repos.service
# (the task's repository checkouts: prepare at start, checkpoints, final save;
# it needs git, which the image provides with the agent's own credentials).
#
#   packaging/install-fsagent.sh --user AGENT_USER --home AGENT_HOME \
#       --controller URL --token-file FILE [--bridge-port N] [--allow-other] \
#       [--source DIR] [--no-systemd]
#
# Run as root inside the sandbox image build.  Installs the Debian packages
# fsagent needs (fuse3, python3-venv, git), the package from --source (default: this
# checkout) into /opt/fsagent/venv, the units into /etc/systemd/system and their
# configuration into /etc/fsagent/fsagent.env.  Nothing is started.
set -euo pipefail

src="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=env-quote.sh
. "$(dirname "$0")/env-quote.sh"
user="" home="" controller="" token_file="" args="" systemd=1 bridge_port=8751
while (($#)); do
    case "$1" in
        --user) user="$2"; shift 2 ;;
        --home) home="$2"; shift 2 ;;
        --controller) controller="$2"; shift 2 ;;
        --token-file) token_file="$2"; shift 2 ;;
        --bridge-port) bridge_port="$2"; shift 2 ;;
        --allow-other) args="--allow-other"; shift ;;
        --source) src="$2"; shift 2 ;;
        --package) package="$2"; shift 2 ;;
        --no-systemd) systemd=0; shift ;;
        *) echo "install-fsagent.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [[ $(id -u) -ne 0 ]]; then
    echo "install-fsagent.sh: run as root" >&2
    exit 1
fi
for v in user home controller token_file; do
    if [[ -z "${!v}" ]]; then
        echo "install-fsagent.sh: --${v//_/-} is required" >&2
        exit 2
    fi
done
if ! [[ "$bridge_port" =~ ^[0-9]+$ ]] || ((bridge_port < 1 || bridge_port > 65535)); then
    echo "install-fsagent.sh: --bridge-port must be a port number, got $bridge_port" >&2
    exit 2
fi

missing=()
for p in fuse3 python3 python3-venv git; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

install -d -m 0755 /opt/fsagent
[[ -x /opt/fsagent/venv/bin/python ]] || python3 -m venv /opt/fsagent/venv
/opt/fsagent/venv/bin/pip install -q --upgrade pip
# --package SPEC installs SPEC (e.g. a wheel built beforehand; with PIP_NO_INDEX
# and PIP_FIND_LINKS, offline from a wheelhouse) instead of the --source tree.
# No extra: the base dependencies are fsagent's, none of the controller's
# (PostgreSQL, S3, Starlette, Prometheus: its `controller` extra).
/opt/fsagent/venv/bin/pip install -q "${package:-$src}"
# pyfuse3 with fsagent's patch (packaging/pyfuse3/README.md): a wheel of it in
# the wheelhouse, else built from the sdist when the index and build tools are
# at hand. Without it fsagent still works, with more FUSE requests per operation.
build_pyfuse3="$src/packaging/pyfuse3/build.sh"
if [[ -f "$build_pyfuse3" ]]; then
    want="$(sed -n 's/^version=//p' "$build_pyfuse3")+$(sed -n 's/^label=//p' "$build_pyfuse3")"
    wheels="$(mktemp -d)"
    if ! /opt/fsagent/venv/bin/pip install -q --no-deps "pyfuse3==$want" 2>/dev/null \
        && ! "$build_pyfuse3" --python /opt/fsagent/venv/bin/python --wheel-dir "$wheels" \
            --install >/dev/null 2>&1; then
        echo "install-fsagent.sh: pyfuse3 $want is not available; the stock pyfuse3 stays" \
            "(fsagent works, with more FUSE requests per operation)" >&2
    fi
    rm -rf "$wheels"
fi
/opt/fsagent/venv/bin/fsagent --help >/dev/null

if [[ -n "$args" ]] && ! grep -q '^user_allow_other' /etc/fuse.conf 2>/dev/null; then
    # allow_other from an unprivileged fsagent needs this switch.
    echo user_allow_other >>/etc/fuse.conf
fi

install -d -m 0755 /etc/fsagent
# The units' EnvironmentFile: quoted, so a home or token path with spaces or
# quotes reaches them whole (their ${VAR} words stay one argument each).
q_user="$(env_quote "$user")" q_home="$(env_quote "$home")"
q_controller="$(env_quote "$controller")" q_token_file="$(env_quote "$token_file")"
q_args="$(env_quote "$args")" q_port="$(env_quote "$bridge_port")"
umask 077
cat >/etc/fsagent/fsagent.env <<ENV
FSAGENT_USER=$q_user
FSAGENT_HOME=$q_home
FSAGENT_CONTROLLER=$q_controller
FSAGENT_TOKEN_FILE=$q_token_file
FSAGENT_ARGS=$q_args
FSAGENT_BRIDGE_PORT=$q_port
ENV
chmod 0644 /etc/fsagent/fsagent.env
umask 022  # the units and drop-ins below are world-readable, as systemd expects

if ((systemd)); then
    group="$(id -gn "$user")"
    for unit in fsagent@.service fsagent-bridge.service fsagent-repos.service; do
        install -m 0644 "$src/packaging/systemd/$unit" "/etc/systemd/system/$unit"
        install -d -m 0755 "/etc/systemd/system/$unit.d"
        printf '[Service]\nUser=%s\nGroup=%s\n' "$user" "$group" \
            >"/etc/systemd/system/$unit.d/user.conf"
    done
    if command -v systemctl >/dev/null && [[ -d /run/systemd/system ]]; then
        systemctl daemon-reload
    fi
fi
echo "fsagent installed in /opt/fsagent/venv; enable with:"
echo "  systemctl enable --now fsagent-bridge fsagent-repos fsagent@task fsagent@agent fsagent@user fsagent@project"
