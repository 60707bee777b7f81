"""mkdocs hooks (mkdocs.yml ``hooks:``).

1. A pipe inside a code span in a table cell is written ``\\|`` so that the
   table keeps its columns; Python-Markdown keeps the backslash inside the
   code, where GitHub drops it. Drop it in the rendered code too.
2. The dated benchmark logs live in ``bench/results/``, beside the code that
   writes them, not under ``docs/``. The site takes each of them in as a page
   under ``bench-results/``, lists them in the nav under "Benchmarks", and
   rewrites repository-relative links between the two trees (``../bench/results/X.md``
   from a page, ``../../docs/X.md`` from a log: they work when reading the
   files in a clone) into links between pages.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_CODE = re.compile(r"<code>(.*?)</code>", re.S)
_LINK = re.compile(r"\]\(((?:\.\./)+[^)#\s:]+\.md)(#[^)\s]*)?\)")

REPO = Path(__file__).resolve().parent.parent
LOGS = REPO / "bench" / "results"
SITE_DIR = "bench-results"


def _logs() -> list[Path]:
    return sorted(LOGS.glob("*.md"))


def on_config(config: Any, **kwargs: Any) -> Any:
    nav = config["nav"] or []
    for i, item in enumerate(nav):
        if isinstance(item, dict) and list(item) == ["Benchmarks"]:
            page = item["Benchmarks"]
            logs = [{log.stem: f"{SITE_DIR}/{log.name}"} for log in reversed(_logs())]
            nav[i] = {"Benchmarks": [page, {"Dated logs": logs}]}
    return config


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    for log in _logs():
        files.append(File.generated(config, f"{SITE_DIR}/{log.name}", abs_src_path=str(log)))
    return files


def _site_path(repo_path: str) -> str | None:
    """The page a repository path is on the site, if it is one."""
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/") :]
    if repo_path.startswith("bench/results/"):
        return f"{SITE_DIR}/{posixpath.basename(repo_path)}"
    return None


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    src = page.file.src_uri
    if src.startswith(f"{SITE_DIR}/"):
        repo_dir = "bench/results"
    else:
        repo_dir = posixpath.join("docs", posixpath.dirname(src))
    site_dir = posixpath.dirname(src) or "."

    def relink(m: re.Match[str]) -> str:
        target = _site_path(posixpath.normpath(posixpath.join(repo_dir, m.group(1))))
        if target is None:
            return m.group(0)
        return f"]({posixpath.relpath(target, site_dir)}{m.group(2) or ''})"

    return _LINK.sub(relink, markdown)


def on_page_content(html: str, **kwargs: Any) -> str:
    return _CODE.sub(lambda m: "<code>" + m.group(1).replace("\\|", "|") + "</code>", html)
