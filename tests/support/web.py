"""Drive the Files page in Debian's headless Chromium through Playwright.

No browser is downloaded: Playwright launches /usr/bin/chromium (the
`chromium` package) via ``executable_path``.
"""

from __future__ import annotations

import base64
import shutil
import struct
import subprocess
import tarfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from playwright.sync_api import Browser, Locator, Page, Playwright, expect

from tests.support.constants import REPO
from tests.support.controller import Tenant

CHROMIUM = "/usr/bin/chromium"
# Root in a container has no user namespace for Chromium's sandbox; the rest
# keeps the browser from phoning home or updating itself during tests.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = REPO / "test-artifacts"


def launch_chromium(pw: Playwright) -> Browser:
    return pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def png_bytes(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A valid, solid-colour RGB PNG built by hand (no imaging library needed)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    row = b"\x00" + bytes(rgb) * width  # filter byte 0, then the pixels
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


_DROP_JS = """
([selector, files]) => {
  const dt = new DataTransfer();
  for (const f of files) {
    const bytes = Uint8Array.from(atob(f.b64), (c) => c.charCodeAt(0));
    dt.items.add(new File([bytes], f.name, { type: f.type }));
  }
  const target = document.querySelector(selector);
  if (!target) throw new Error(`no drop target ${selector}`);
  for (const type of ["dragenter", "dragover", "drop"]) {
    const init = { bubbles: true, cancelable: true, dataTransfer: dt };
    target.dispatchEvent(new DragEvent(type, init));
  }
}
"""


def drop_files(page: Page, selector: str, files: list[tuple[str, str, bytes]]) -> None:
    """Drop (name, content type, bytes) files on `selector` with a real DataTransfer."""
    payload = [
        {"name": name, "type": ctype, "b64": base64.b64encode(data).decode()}
        for name, ctype, data in files
    ]
    page.evaluate(_DROP_JS, [selector, payload])


def sign_in(page: Page, base_url: str, token: str, path: str = "/files/") -> None:
    page.goto(base_url + path)
    page.get_by_label("API token").fill(token)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("button", name="Sign out").wait_for()


def sign_out(page: Page, timeout_ms: float = 120_000) -> None:
    """Sign out from the page's button and wait until the sign-in form shows.

    The button's DELETE of the session is asynchronous: a navigation started
    right after the click could still carry the session's cookie and land
    signed in, with no token field to fill (seen in a fresh-clone CI run)."""
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("heading", name="Sign in to Files")).to_be_visible(timeout=timeout_ms)


@dataclass
class ViewRecorder:
    """Screenshots of the main views, kept only when the test fails."""

    scratch: Path
    page: Page | None = None
    taken: list[Path] = field(default_factory=list)

    def snap(self, name: str) -> None:
        assert self.page is not None, "no page to take a screenshot of"
        path = self.scratch / f"{len(self.taken) + 1:02d}-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        self.taken.append(path)

    def keep(self, test_name: str, console: list[str], *, final: bool = True) -> Path:
        """Copy the screenshots, a final one (``final``) and the console log to test-artifacts/."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in test_name)
        target = ARTIFACTS / safe
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for path in self.taken:
            shutil.copy(path, target / path.name)
        try:
            if final and self.page is not None:
                self.page.screenshot(path=str(target / "at-failure.png"), full_page=True)
        except Exception as exc:  # the page may be gone; the rest is still useful
            console.append(f"(final screenshot failed: {exc})")
        (target / "console.log").write_text("\n".join(console) + "\n")
        return target


def escape_in_the_frame(page: Page, preview: Locator, timeout_ms: float = 120_000) -> None:
    """Escape, pressed while the PDF viewer's frame has focus, closes the preview.

    The key goes down in the frame and comes up in the page: closing the
    preview removes the frame, and Chromium never acknowledges a key event
    routed to a frame that is gone, so ``keyboard.press`` (down, then up)
    waited forever for the key up (seen on a loaded machine, in 1 of about
    10 runs, and in three fresh-clone CI runs of the Files page's preview
    test, until the watchdog ended the browser)."""
    page.keyboard.down("Escape")
    expect(preview).to_be_hidden(timeout=timeout_ms)
    page.keyboard.up("Escape")


def entry_by_path(entries: list[dict[str, Any]], path: str) -> dict[str, Any] | None:
    return next((e for e in entries if e["path"] == path), None)


def row_action(row: Locator, name: str, action: str) -> None:
    """Choose ``action`` ("Rename…", "Delete…", …) from the row menu of the entry ``name``."""
    row.get_by_role("button", name=f"Actions for {name}", exact=True).click()
    row.get_by_role("menuitem", name=action, exact=True).click()


def folder_url(tenant: Tenant, scope: str, owner_id: str) -> str:
    return f"/files/{tenant.company_id}/{scope}/{owner_id}"


def api_entries(tenant: Tenant, folder: str, *, trash: bool = False) -> list[dict[str, Any]]:
    with tenant.client() as client:
        resp = client.get(folder + "/", params={"trash": str(trash).lower(), "limit": 1000})
        resp.raise_for_status()
        entries: list[dict[str, Any]] = resp.json()["entries"]
        return entries


def put_file(tenant: Tenant, folder: str, path: str, data: bytes) -> None:
    with tenant.client() as client:
        resp = client.put(
            folder + "/content",
            params={"path": path},
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert resp.status_code in (200, 201), resp.text


def operate_all(
    tenant: Tenant, folder: str, bodies: list[dict[str, Any]], workers: int = 4
) -> None:
    """POST each of ``bodies`` to the folder's operations, ``workers`` clients
    at a time, each answered 200: a fixture of many operations whose order
    does not matter (mkdirs of distinct paths), made in a fraction of the time
    one client takes (the controller applies them one at a time all the same)."""

    def post(share: list[dict[str, Any]]) -> None:
        with tenant.client() as client:
            for body in share:
                resp = client.post(folder + "/operations", json=body)
                assert resp.status_code == 200, (body, resp.text)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(post, [bodies[i::workers] for i in range(workers)]))


def tab(page: Page, name: str) -> Locator:
    return page.get_by_role("navigation", name="Folder views").get_by_role("link", name=name)


def listing_row(page: Page, path: str) -> Locator:
    return page.locator(f'.files-view tbody tr[data-path="{path}"]')


def trash_row(page: Page, path: str) -> Locator:
    return page.locator(f'.trash-view tbody tr[data-path="{path}"]')


AXE_VERSION = "4.10.3"
AXE_CACHE = REPO / ".test-cache" / f"axe-core-{AXE_VERSION}"


def axe_source() -> str:
    """axe-core's browser build, fetched once with npm into a cache the tests own.

    It is injected into the page under test only; the controller never serves it.
    """
    script = AXE_CACHE / "package" / "axe.min.js"
    if not script.exists():
        AXE_CACHE.mkdir(parents=True, exist_ok=True)
        out = subprocess.run(
            [
                "npm",
                "pack",
                f"axe-core@{AXE_VERSION}",
                "--silent",
                "--pack-destination",
                str(AXE_CACHE),
            ],
            capture_output=True,
            text=True,
            timeout=180,
            check=True,
        )
        tarball = AXE_CACHE / out.stdout.strip().splitlines()[-1]
        with tarfile.open(tarball) as tar:
            tar.extract("package/axe.min.js", AXE_CACHE, filter="data")
        tarball.unlink()
    return script.read_text()


def axe_violations(page: Page, impacts: tuple[str, ...] = ("serious", "critical")) -> list[str]:
    """Run axe-core on the page as it is; one line per violation of those impacts."""
    if not page.evaluate("() => typeof window.axe !== 'undefined'"):
        # Evaluated through the DevTools protocol, which the page's CSP does not
        # govern: the page itself can still load nothing but its own scripts.
        page.evaluate(axe_source() + "\n;undefined")
    result = page.evaluate(
        "async () => (await axe.run(document, { resultTypes: ['violations'] })).violations"
        ".map(v => ({ id: v.id, impact: v.impact, help: v.help,"
        " nodes: v.nodes.map(n => n.target.join(' ')).slice(0, 5) }))"
    )
    return [
        f"{v['impact']}: {v['id']} ({v['help']}) at {v['nodes']}"
        for v in result
        if v["impact"] in impacts
    ]


def build_pdf(objects: list[bytes]) -> bytes:
    """A PDF of `objects` (object 1 is the catalog) with a correct xref table."""
    out = b"%PDF-1.4\n"
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        xref,
    )
    return out
