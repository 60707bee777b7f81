#!/usr/bin/env bash
# Build pyfuse3 with fsagent's patch (pyfuse3-3.5.0-fsagent.patch, see
# README.md here) as a wheel, and optionally install it.
#
#   packaging/pyfuse3/build.sh [--python PY] [--wheel-dir DIR] [--install]
#
# The sdist comes from the package index (pip download, checked against its
# SHA-256), the patch is applied to it and pip builds the wheel (Cython comes
# in as a build dependency; gcc, pkg-config and libfuse3-dev are needed, see
# packaging/install-deps.sh). The wheel's version carries a local label
# (3.5.0+fsagent.N), so `pip show pyfuse3` tells the patched build apart. A
# wheel already in --wheel-dir (default build/pyfuse3-wheels) is reused.
# --install installs it into PY's environment (default python3), replacing
# whatever pyfuse3 is there. fsagent runs with a stock pyfuse3 too, only slower.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
version=3.5.0
label=fsagent.2
sdist_sha256=88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24
py=python3 wheel_dir="$here/../../build/pyfuse3-wheels" install=0
while (($#)); do
    case "$1" in
        --python) py="$2"; shift 2 ;;
        --wheel-dir) wheel_dir="$2"; shift 2 ;;
        --install) install=1; shift ;;
        *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$wheel_dir"
wheel_dir="$(cd "$wheel_dir" && pwd)"
tag="$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"

find_wheel() {
    local w
    for w in "$wheel_dir"/pyfuse3-"$version"+"$label"-"$tag"-*.whl; do
        [[ -f "$w" ]] && { echo "$w"; return 0; }
    done
    return 1
}

if ! wheel="$(find_wheel)"; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    "$py" -m pip download -q --no-deps --no-binary pyfuse3 -d "$work" "pyfuse3==$version"
    sdist="$work/pyfuse3-$version.tar.gz"
    echo "$sdist_sha256  $sdist" | sha256sum --check --quiet -
    tar -xzf "$sdist" -C "$work"
    patch -s -d "$work/pyfuse3-$version" -p1 <"$here/pyfuse3-$version-fsagent.patch"
    SETUPTOOLS_SCM_PRETEND_VERSION="$version+$label" \
        "$py" -m pip wheel -q --no-deps --wheel-dir "$wheel_dir" "$work/pyfuse3-$version"
    wheel="$(find_wheel)"
fi
echo "$wheel"
if ((install)); then
    "$py" -m pip install -q --no-deps --force-reinstall "$wheel"
fi
