"""What every test that starts ``make demo`` (``controller.demo``) checks of
its agent: the printed "Agent:" link opens the Files page, the agent exists
with its instruction entry, and that entry holds the demo's instructions, on
the controller and in the sandbox's agent folder."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from controller.demo import DEMO_INSTRUCTIONS

_AGENT_LINK = re.compile(
    r"^Agent: +(?P<base>http://[^/\s]+)/files/(?P<company>[0-9a-f-]{36})/agent/"
    r"(?P<agent>[0-9a-f-]{36}) +\(\"Instructions\" edits its AGENTS\.md\)$",
    re.MULTILINE,
)


def check_demo_agent(text: str, home: Path | None) -> None:
    """``text``: the demo's output; ``home``: its sandbox home (None with --no-mount)."""
    token = re.search(r"^API token: +(\S+)$", text, re.MULTILINE)
    link = _AGENT_LINK.search(text)
    assert token and link, text
    base, company, agent = link["base"], link["company"], link["agent"]
    page = httpx.get(f"{base}/files/{company}/agent/{agent}", timeout=30)
    assert page.status_code == 200, page.text
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "<title>Files</title>" in page.text and "/files/static/app.js" in page.text
    auth = {"Authorization": f"Bearer {token[1]}"}
    # What the page asks for to show "Instructions": the agent and its entry.
    described = httpx.get(
        f"{base}/api/companies/{company}/agents/{agent}", headers=auth, timeout=30
    )
    assert described.status_code == 200, described.text
    assert described.json()["id"] == agent and described.json()["entryPath"] == "AGENTS.md"
    entry = httpx.get(
        f"{base}/api/companies/{company}/work-folders/agent/{agent}/content",
        params={"path": "AGENTS.md"},
        headers=auth,
        timeout=30,
    )
    assert entry.status_code == 200, entry.text
    assert entry.content == DEMO_INSTRUCTIONS.encode() and entry.content.strip()
    if home is not None:
        assert (home / "agent" / "AGENTS.md").read_bytes() == DEMO_INSTRUCTIONS.encode()
