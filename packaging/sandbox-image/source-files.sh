#!/usr/bin/env bash
# The files of a source tree that the sandbox image's build copies in:
# NUL-separated paths relative to SRC, on stdout.
#
#   packaging/sandbox-image/source-files.sh SRC
#
# build-rootfs.sh builds and installs fsagent from them inside the image, so
# only what that needs goes in (an allowlist, as
# packaging/controller.Dockerfile.dockerignore has): the package (pyproject.toml,
# README.md, its readme, and common/, controller/, fsagent/), the install script
# and what it reads (env-quote.sh, the systemd units, the pyfuse3 patch).
# Never the demo's data (.demo/: its embedded database, run token and API
# token), a sandbox home (demo-home/, whose folders may be live FUSE mounts),
# virtualenvs, build output or anything named like a secret, wherever it is.
#
# In a Git checkout the list is Git's (tracked files, and untracked ones that
# are not ignored) under those paths only, so Git never walks another
# directory; elsewhere find(1) lists them without leaving SRC's filesystem.
# Listed files that do not exist (deleted in the work tree) are left out. A
# file left out for its name is named on stderr.
set -euo pipefail

src="${1:?usage: source-files.sh SRC}"
cd "$src"

# What install-fsagent.sh installs from the source tree.
include=(
    pyproject.toml README.md common controller fsagent
    packaging/install-fsagent.sh packaging/env-quote.sh packaging/systemd packaging/pyfuse3
)

# A path none of whose components may be one of these (shell patterns).
secret_like() {
    local rest="$1" part
    while :; do
        part="${rest%%/*}"
        case "$part" in
            .demo | demo-home | .venv | venv | .git | .ssh | .gnupg | .aws | .docker | \
                __pycache__ | build | *.egg-info | .*_cache | .hypothesis | node_modules | \
                .env | .env.* | *.env | .envrc | .netrc | .git-credentials | .pgpass | \
                token | *.token | *-token | *_token | *.tokens | demo.json | \
                *.db | *.db-* | *.sqlite | *.sqlite3 | *.dump | \
                id_rsa* | id_dsa* | id_ecdsa* | id_ed25519* | *.pem | *.key | *.p12 | *.pfx | \
                *.keystore | *.jks | *.crt | *.kdbx | credentials | credentials.* | secrets | \
                secrets.* | *.so | *.pyc | *.pyo)
                return 0 ;;
        esac
        [[ "$rest" == */* ]] || return 1
        rest="${rest#*/}"
    done
}

list() {
    local present=()
    local p
    for p in "${include[@]}"; do
        [[ ! -e "$p" ]] || present+=("$p")
    done
    ((${#present[@]})) || return 0
    if [[ "$(git rev-parse --show-toplevel 2>/dev/null || true)" == "$(pwd -P)" ]]; then
        git -c core.quotePath=false ls-files -z --cached --others --exclude-standard \
            -- "${present[@]}"
    else
        find "${present[@]}" -xdev \( -type f -o -type l \) -print0
    fi
}

list | while IFS= read -r -d '' path; do
    path="${path#./}"
    if secret_like "$path"; then
        printf 'source-files.sh: left out (named like a secret or not part of the package): %s\n' \
            "$path" >&2
        continue
    fi
    # Regular files and links only: a tracked file deleted in the work tree is
    # not there to copy.
    [[ -f "$path" || -L "$path" ]] || continue
    printf '%s\0' "$path"
done
