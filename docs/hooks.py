"""mkdocs hooks (mkdocs.yml ``hooks:``).

A pipe inside a code span in a table cell is written ``\\|`` so that the
table keeps its columns; Python-Markdown keeps the backslash inside the code,
where GitHub drops it. Drop it in the rendered code too.
"""

from __future__ import annotations

import re
from typing import Any

_CODE = re.compile(r"<code>(.*?)</code>", re.S)


def on_page_content(html: str, **kwargs: Any) -> str:
    return _CODE.sub(lambda m: "<code>" + m.group(1).replace("\\|", "|") + "</code>", html)
