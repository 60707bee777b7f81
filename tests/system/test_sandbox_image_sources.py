"""What the sandbox image's build copies in to build fsagent
(packaging/sandbox-image/source-files.sh, which build-rootfs.sh uses): the
package, the units and the install script, never a secret-looking file (the
demo's embedded database and tokens in .demo/, a sandbox home, a virtualenv,
keys, env files, databases), tracked by Git or not, in a Git checkout or a
plain copy. Fast: no image is built here (test_sandbox_boot.py builds one)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.constants import REPO

IMAGE = REPO / "packaging" / "sandbox-image"
SELECT = IMAGE / "source-files.sh"

NEEDED = {
    "pyproject.toml": "[project]\nname = 'x'\n",
    "README.md": "# x\n",
    "fsagent/cli.py": "print('fsagent')\n",
    "fsagent/_lstat.c": "int x;\n",
    "controller/tokens.py": "# a module about tokens is source, not a token\n",
    "controller/db/migrations/0011_operator_tokens.sql": "SELECT 1;\n",
    "controller/web/app.js": "1;\n",
    "common/paths.py": "X = 1\n",
    "packaging/install-fsagent.sh": "#!/bin/sh\n",
    "packaging/env-quote.sh": "#!/bin/sh\n",
    "packaging/systemd/fsagent@.service": "[Unit]\n",
    "packaging/pyfuse3/build.sh": "#!/bin/sh\n",
}
"""Files the image's build needs: each is selected."""

SECRETS = {
    ".demo/run-token": "fsa_r_secret",
    ".demo/demo.json": '{"token": "fsa_u_secret"}',
    ".demo/pg/base/1/1259": "database page",
    "demo-home/task/notes.md": "through a live mount",
    ".venv/bin/activate": "venv",
    ".env": "AWS_SECRET_ACCESS_KEY=x",
    "fsagent/.env": "TOKEN=x",
    "fsagent/.env.local": "TOKEN=x",
    "controller/run-token": "fsa_r_secret",
    "controller/api.token": "fsa_u_secret",
    "controller/data.db": "sqlite",
    "controller/web/cache.sqlite3": "sqlite",
    "common/id_rsa": "-----BEGIN OPENSSH PRIVATE KEY-----",
    "common/id_ed25519.pub": "ssh-ed25519 AAAA",
    "packaging/systemd/server.key": "-----BEGIN PRIVATE KEY-----",
    "packaging/pyfuse3/client.pem": "-----BEGIN CERTIFICATE-----",
    "fsagent/.ssh/config": "Host *",
    "fsagent/credentials.json": "{}",
    "controller/.demo/run-token": "nested",
    "fsagent/__pycache__/cli.cpython-311.pyc": "bytecode",
    "fsagent/_lstat.cpython-311-x86_64-linux-gnu.so": "ELF",
    "tests/fixtures/key.txt": "not part of the package",
    "bench/notes.md": "not part of the package",
}
"""Files that must never reach the image, wherever they sit."""


def selected(src: Path) -> tuple[set[str], str]:
    out = subprocess.run([str(SELECT), str(src)], capture_output=True, check=True, timeout=60)
    names = {p.decode() for p in out.stdout.split(b"\0") if p}
    return names, out.stderr.decode()


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A Git checkout holding what the build needs and every kind of secret:
    some committed (by mistake, with add -f), some untracked, some ignored."""
    root = tmp_path / "src"
    write_tree(root, {**NEEDED, **SECRETS, ".gitignore": ".venv\n.demo/\ndemo-home/\n*.so\n"})
    git(root, "init", "-q")
    git(root, "add", *NEEDED, ".gitignore")
    git(root, "add", "-f", "controller/run-token", "common/id_rsa", ".env", ".demo/run-token")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "tree")
    return root


def test_a_checkout_gives_what_the_build_needs_and_no_secret(checkout: Path) -> None:
    names, said = selected(checkout)
    assert names == set(NEEDED)
    # A committed secret is left out too, and named.
    for rel in ("controller/run-token", "common/id_rsa"):
        assert f": {rel}\n" in said, said


def test_a_plain_copy_gives_the_same(checkout: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git"))
    names, _ = selected(copy)
    assert names == set(NEEDED)


def test_an_untracked_new_module_goes_in_and_a_deleted_file_does_not(checkout: Path) -> None:
    """The work tree is what is built: a module not committed yet is part of
    it, a committed file deleted since is not (and breaks nothing)."""
    (checkout / "fsagent" / "newmodule.py").write_text("X = 2\n")
    (checkout / "common" / "paths.py").unlink()
    names, _ = selected(checkout)
    assert names == (set(NEEDED) - {"common/paths.py"}) | {"fsagent/newmodule.py"}


def test_this_checkout_gives_its_package_and_no_secret() -> None:
    names, _ = selected(REPO)
    tracked = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--", "fsagent", "controller", "common"],
        capture_output=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    package = {p.decode() for p in tracked.split(b"\0") if p and (REPO / p.decode()).exists()}
    assert package <= names
    assert {"pyproject.toml", "README.md", "packaging/install-fsagent.sh"} <= names
    allowed = ("fsagent/", "controller/", "common/", "packaging/systemd/", "packaging/pyfuse3/")
    extra = {n for n in names if not n.startswith(allowed)}
    assert extra <= {"pyproject.toml", "README.md", "packaging/install-fsagent.sh",
                     "packaging/env-quote.sh"}, extra  # fmt: skip
    secret = re.compile(
        r"(^|/)(\.demo|demo-home|\.venv|\.env[^/]*|[^/]*\.(token|db|pem|key)|id_rsa[^/]*)(/|$)"
    )
    assert not [n for n in names if secret.search(n)]


def test_build_rootfs_copies_only_the_selected_files() -> None:
    build = (IMAGE / "build-rootfs.sh").read_text()
    assert '"$here/source-files.sh" "$src" | tar -C "$src" --null --no-recursion -T - -cf -' in (
        build
    )
    # No other copy of the source tree into the image.
    copies = re.findall(r"tar -C \"\$src\"[^\n]*", build)
    assert len(copies) == 1, copies
    assert "trap clean_up EXIT" in build and 'rm -rf "$stage"' in build
