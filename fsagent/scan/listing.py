"""When Git's listing of a working tree can be used again without running Git.

``git ls-files -z --cached --others --exclude-standard`` (the members of a
repository checkpoint's working tree) reads every directory of the working
tree; on 20,000 files it costs more than the rest of a checkpoint that
changed nothing but a few files' contents. Its answer depends only on:

* the entries of every directory Git may descend into: this module keeps
  the set of *every* directory of the working tree outside ``.git`` (ignored
  and empty ones included, a superset of Git's), found by reading them;
* the ignore rules: every ``.gitignore`` in those directories, ``.git/info/
  exclude``, the excludes file (``core.excludesFile`` or its XDG default);
* the index (``.git/index``; ``.git`` itself, whose entries change with any
  Git write, and ``.git/info`` with ``sparse-checkout``);
* the configuration: ``.git/config``, the global and system files, as the
  environment names them, and the environment itself.

Each is witnessed by its ``lstat`` key (device, inode, size, mode, mtime,
ctime): adding, removing or renaming an entry changes its directory's
ctime, and a file written in place changes its own; ctime cannot be set
back. A directory's key is taken *before* its entries are read, so a change
made while it is read shows as a changed key next time. A witness whose
mtime or ctime lies within the racy margin of the observation may still
change within the same timestamp tick: the next observation does not vouch.

:meth:`ListingWitness.unchanged` observes everything now and says whether it
equals the last observation, which was settled: then a listing taken after
that observation is still the listing. It never vouches for what it cannot
see whole: a configuration with includes or ``core.fsmonitor``, a nested
repository (a directory holding ``.git``), a ``.gitignore`` that is not a
regular file, a directory it could not read, a tree of more than
:data:`MAX_WATCHED_DIRS` directories (dependencies Git never reads, such as
an ignored ``node_modules``, would cost more to watch than to list).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterable
from typing import Final

from common.repos import GIT_DIR
from fsagent.scan.engine import DIR_FLAGS, RACY_MARGIN_NS, Key, lstat_keys

IGNORE_FILE: Final = ".gitignore"

ConfigReader = Callable[[], list[tuple[str, str, str]] | None]
"""``(scope, origin, "key\\nvalue")`` of every configuration entry Git sees
(:func:`parse_config_list`); None when Git could not read it."""


def _truthy(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true", "yes", "on")


def config_files(env: dict[str, str]) -> list[str]:
    """The configuration files Git reads (besides the repository's), as
    ``env`` names them, whether or not they exist."""
    home = env.get("HOME", "")
    xdg = env.get("XDG_CONFIG_HOME") or (f"{home}/.config" if home else "")
    files: list[str] = []
    if "GIT_CONFIG_GLOBAL" in env:
        files.append(env["GIT_CONFIG_GLOBAL"])
    else:
        if home:
            files.append(f"{home}/.gitconfig")
        if xdg:
            files.append(f"{xdg}/git/config")
    if not _truthy(env.get("GIT_CONFIG_NOSYSTEM")):
        files.append(env.get("GIT_CONFIG_SYSTEM", "/etc/gitconfig"))
    return [f for f in files if f]


class ListingWitness:
    """The state of everything a working tree's listing depends on (see the
    module doc), compared observation by observation."""

    def __init__(
        self, checkout: str, read_config: ConfigReader, racy_margin_ns: int = RACY_MARGIN_NS
    ) -> None:
        self.root = checkout
        self.read_config = read_config
        self.racy_margin_ns = racy_margin_ns
        self._env: dict[str, str] | None = None
        self._dirs: dict[str, Key] = {}
        """Working-tree directory (``.`` the root) -> its key when last read."""
        self._subdirs: dict[str, list[str]] = {}
        self._ignores: dict[str, Key | None] = {}
        """The ``.gitignore`` of each known directory that has one -> its key."""
        self._blind: set[str] = set()
        """Directories whose entries keep the witness from vouching (a nested
        repository, a .gitignore that is not a file) or that could not be read."""
        self._config: dict[str, Key | None] = {}
        self._config_vouches = False
        self._outside: dict[str, Key | None] = {}
        """Git's own files and the excludes file (absolute paths) -> their keys."""
        self._excludes: str | None = None
        self._settled = False
        self.gave_up = False
        """More than :data:`MAX_WATCHED_DIRS` directories: Git lists every time."""

    def unchanged(self, env: dict[str, str]) -> bool:
        """Observe everything now; True when it equals the last observation and
        that one was settled and could vouch (a listing taken after it still
        holds). This observation becomes the last one: call it before listing.
        A witness that cannot be looked at (EACCES, ELOOP, ...) vouches for
        nothing: Git lists, and the next observation starts from this one's
        partial state, which it does not trust either."""
        try:
            return self._observe(env)
        except OSError:
            self._settled = False
            return False

    def _observe(self, env: dict[str, str]) -> bool:
        not_after = time.time_ns() - self.racy_margin_ns
        same = self._settled
        if env != self._env:
            self._env, self._config = dict(env), {}
            same = False
        config_paths = [*self._absolute(config_files(env)), f"{self.root}/{GIT_DIR}/config"]
        config = dict(zip(config_paths, lstat_keys(AT_FDCWD, config_paths), strict=True))
        if config != self._config:
            # Read after its files' keys were taken: a change while it is read
            # shows next time.
            self._config = config
            self._read_configuration(env)
            same = False
        git = f"{self.root}/{GIT_DIR}"
        outside_paths = [git, f"{git}/index", f"{git}/info", *(f"{git}/info/{n}" for n in INFO)]
        if self._excludes is not None:
            outside_paths.append(self._excludes)
        outside = dict(zip(outside_paths, lstat_keys(AT_FDCWD, outside_paths), strict=True))
        if outside != self._outside:
            self._outside = outside
            same = False
        if self.gave_up or not self._tree_unchanged():
            same = False
        files = [*config.values(), *outside.values()]
        vouches = (
            not self.gave_up
            and not REDIRECTING.intersection(env)
            and self._config_vouches
            and not self._blind
            and not any(k is not None and stat.S_ISLNK(k[3]) for k in files)
        )
        self._settled = vouches and not _racy(files, not_after) and not self._tree_racy(not_after)
        return same and vouches

    def _absolute(self, paths: list[str]) -> list[str]:
        return [p if os.path.isabs(p) else os.path.join(self.root, p) for p in paths]

    def _read_configuration(self, env: dict[str, str]) -> None:
        """Whether the configuration can be vouched for (every entry from a
        witnessed file, no include, no fsmonitor), and the excludes file."""
        known = {os.path.normpath(p) for p in self._config}
        entries = self.read_config()
        vouches = entries is not None
        excludes: str | None = None
        for _scope, origin, item in entries or []:
            key, _, value = item.partition("\n")
            key = key.lower()
            if origin.startswith("file:"):
                if os.path.normpath(self._absolute([origin[5:]])[0]) not in known:
                    vouches = False  # an included file
            elif origin != "command line:":
                vouches = False  # a blob, standard input: nothing to witness
            if key.startswith(("include.", "includeif.")) or key == "core.fsmonitor":
                vouches = False
            if key == "core.excludesfile":
                excludes = value
        home = env.get("HOME", "")
        if excludes is None:
            xdg = env.get("XDG_CONFIG_HOME") or (f"{home}/.config" if home else "")
            excludes = f"{xdg}/git/ignore" if xdg else None
        elif excludes.startswith("~/"):
            excludes = home + excludes[1:]
        elif excludes.startswith("~"):
            vouches = False  # another user's home
        if excludes is not None:
            excludes = self._absolute([excludes])[0]
        self._config_vouches = vouches
        self._excludes = excludes

    def _tree_unchanged(self) -> bool:
        """Look at every known directory and ignore file; read the directories
        that changed again (new ones whole). True when nothing changed."""
        try:
            fd = os.open(self.root, DIR_FLAGS)
        except OSError:
            self._dirs.clear()
            self._subdirs.clear()
            self._ignores.clear()
            self._blind = {"."}
            return False
        try:
            dirs = list(self._dirs) or ["."]
            ignores = list(self._ignores)
            keys = lstat_keys(fd, dirs + ignores)
            unchanged = bool(self._dirs)
            for path, key in zip(ignores, keys[len(dirs) :], strict=True):
                if path in self._ignores and key != self._ignores[path]:
                    self._ignores[path] = key
                    unchanged = False
            for path, key in zip(dirs, keys[: len(dirs)], strict=True):
                if path in self._blind or key != self._dirs.get(path):
                    unchanged = False
                    if path == "." or path in self._dirs:  # not dropped with its parent
                        self._read(fd, path, key)
            return unchanged
        finally:
            os.close(fd)

    def _forget(self, path: str) -> None:
        """Drop a directory and everything known below it."""
        self._dirs.pop(path, None)
        self._blind.discard(path)
        self._ignores.pop(_ignore_of(path), None)
        for sub in self._subdirs.pop(path, []):
            self._forget(sub)

    def _read(self, fd: int, path: str, key: Key | None) -> None:
        """Read a directory whose key, taken before, is ``key``; and every new
        directory below it the same way."""
        if self.gave_up:
            return
        old = self._subdirs.get(path, [])
        if key is None or stat.S_IFMT(key[3]) != stat.S_IFDIR:
            self._forget(path)  # its parent changed too, and was or will be read
            if path == ".":
                self._blind.add(".")
            return
        if len(self._dirs) >= MAX_WATCHED_DIRS:
            # Mostly ignored trees (dependencies), which Git never reads:
            # watching them would cost more than the listing saves.
            self.gave_up = True
            self._dirs.clear()
            self._subdirs.clear()
            self._ignores.clear()
            self._blind.clear()
            return
        self._dirs[path] = key
        self._blind.discard(path)
        subdirs: list[str] = []
        has_ignore = False
        try:
            with os.scandir(self.root if path == "." else f"{self.root}/{path}") as entries:
                for entry in entries:
                    name = entry.name
                    if name == GIT_DIR:
                        if path != ".":
                            self._blind.add(path)  # a nested repository or submodule
                    elif name == IGNORE_FILE:
                        has_ignore = True
                        if not entry.is_file(follow_symlinks=False):
                            self._blind.add(path)
                    elif entry.is_dir(follow_symlinks=False):
                        subdirs.append(name if path == "." else f"{path}/{name}")
        except OSError:
            self._blind.add(path)
            subdirs = old
        # A .gitignore created or removed changes the directory: only one
        # that is there needs a key of its own (edited in place).
        ignore = _ignore_of(path)
        if has_ignore:
            self._ignores[ignore] = lstat_keys(fd, [ignore])[0]
        else:
            self._ignores.pop(ignore, None)
        for gone in set(old).difference(subdirs):
            self._forget(gone)
        self._subdirs[path] = subdirs
        new = [d for d in subdirs if d not in self._dirs]
        for sub, sub_key in zip(new, lstat_keys(fd, new), strict=True):
            self._read(fd, sub, sub_key)  # returns at once once the witness gave up

    def _tree_racy(self, not_after: int) -> bool:
        return _racy(self._dirs.values(), not_after) or _racy(self._ignores.values(), not_after)


MAX_WATCHED_DIRS: Final = 20_000
"""Directories a witness keeps at most (a 100,000-member checkout of source
has a few thousand); beyond, it gives up for good and Git lists every time."""
INFO: Final = ("exclude", "sparse-checkout")
REDIRECTING: Final = frozenset(
    ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY")
)
"""Variables that make Git read files other than the checkout's: never vouched for."""
AT_FDCWD: Final = -100


def _ignore_of(directory: str) -> str:
    return IGNORE_FILE if directory == "." else f"{directory}/{IGNORE_FILE}"


def _racy(keys: Iterable[Key | None], not_after: int) -> bool:
    """Whether a key's times lie within the racy margin of the observation."""
    return any(k is not None and (k[4] >= not_after or k[5] >= not_after) for k in keys)


def parse_config_list(out: bytes) -> list[tuple[str, str, str]]:
    """``git config -z --list --show-origin --show-scope``: (scope, origin, item)."""
    fields = out.decode("utf-8", "surrogateescape").split("\0")
    if fields and fields[-1] == "":
        fields.pop()
    if len(fields) % 3:
        raise ValueError("unexpected git config output")
    return [(fields[i], fields[i + 1], fields[i + 2]) for i in range(0, len(fields), 3)]
