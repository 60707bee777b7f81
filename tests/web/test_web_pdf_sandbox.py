"""A PDF preview is drawn by pdf.js in a sandboxed frame of an opaque origin.

A PDF is the sandbox's (or anyone's) input, so it is treated as hostile: the
Files page fetches its bytes and hands them to pdf-viewer.html, a frame with
`sandbox="allow-scripts"` (never `allow-same-origin`) whose CSP allows no
network. These tests draw a real PDF, try the frame's reach from inside it
(cookies, the page, the controller), open a PDF whose OpenAction is
JavaScript, and open a broken one.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import Frame, Page, expect

from tests.support.browser import BROWSER_TESTS
from tests.support.controller import Tenant
from tests.support.web import (
    axe_source,
    axe_violations,
    build_pdf,
    escape_in_the_frame,
    folder_url,
    put_file,
    sign_in,
)

pytestmark = BROWSER_TESTS

VENDOR = Path(__file__).resolve().parents[2] / "controller" / "web" / "vendor" / "pdfjs"
BUSY_MS = 120_000
"""How long a check waits for the page on a busy (shared, loaded) machine."""


def text_pdf(texts: list[str], catalog_extra: bytes = b"") -> bytes:
    """One page per text, each in 36 pt Helvetica (objects: catalog, pages,
    font, then a page and its content stream per text)."""
    kids = b" ".join(b"%d 0 R" % (4 + 2 * i) for i in range(len(texts)))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R %s >>" % catalog_extra,
        b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, len(texts)),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for i, text in enumerate(texts):
        stream = f"BT /F1 36 Tf 30 90 Td ({text}) Tj ET".encode()
        objects.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 400 200] /Contents %d 0 R"
            b" /Resources << /Font << /F1 3 0 R >> >> >>" % (5 + 2 * i)
        )
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream))
    return build_pdf(objects)


INK = """
() => [...document.querySelectorAll("canvas")].map((c) => {
  const { data } = c.getContext("2d").getImageData(0, 0, c.width, c.height);
  let dark = 0, white = 0;
  for (let i = 0; i < data.length; i += 4) {
    if (data[i + 3] > 200 && data[i] < 100 && data[i + 1] < 100 && data[i + 2] < 100) dark++;
    if (data[i + 3] > 200 && data[i] > 240 && data[i + 1] > 240 && data[i + 2] > 240) white++;
  }
  return { label: c.getAttribute("aria-label"), width: c.width, dark, white };
})
"""
"""Each canvas of the viewer: its label and how many dark (text) and white
(page) pixels it has."""


def open_preview(page: Page, tenant: Tenant, name: str) -> None:
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "user", tenant.user_id))
    page.get_by_role("link", name=f"Open {name}").click()


def viewer_frame(page: Page, name: str) -> Frame:
    """The preview's viewer frame, once its document runs."""
    frame_el = page.locator(f".preview iframe[title='Preview of {name}']")
    expect(frame_el).to_be_visible(timeout=BUSY_MS)
    handle = frame_el.element_handle()
    frame = handle.content_frame()
    assert frame is not None
    frame.wait_for_function("() => document.readyState === 'complete'", timeout=BUSY_MS)
    return frame


def wait_for_pages(frame: Frame, count: int) -> list[dict[str, Any]]:
    """The viewer's canvases once `count` of them have ink on them."""
    frame.wait_for_function(
        f"() => ({INK})().filter((c) => c.dark > 0).length >= {count}", timeout=BUSY_MS
    )
    pages: list[dict[str, Any]] = frame.evaluate(INK)
    return pages


def test_a_pdf_is_drawn_by_pdfjs_in_the_sandboxed_frame(page: Page, tenant: Tenant) -> None:
    put_file(tenant, tenant.my_folder, "report.pdf", text_pdf(["Hello sandbox", "Second page"]))
    open_preview(page, tenant, "report.pdf")
    preview = page.locator(".preview")
    frame = viewer_frame(page, "report.pdf")
    assert frame.url.endswith("/files/static/pdf-viewer.html")

    pages = wait_for_pages(frame, 2)
    assert [p["label"] for p in pages] == ["Page 1 of 2", "Page 2 of 2"]
    # pdf.js parses in a worker thread (a classic worker from a blob: URL made
    # in the frame), not in the frame's own thread (globalThis.pdfjsWorker).
    assert [w.url for w in page.workers if w.url.startswith("blob:null/")], page.workers
    assert frame.evaluate("() => globalThis.pdfjsWorker === undefined")
    for drawn in pages:
        # 36 pt text on a white 400x200 pt page: hundreds of dark pixels, and
        # mostly white paper (a blank or black canvas would be neither).
        assert drawn["dark"] > 300, drawn
        assert drawn["white"] > drawn["dark"] * 5, drawn
    expect(preview.get_by_role("status")).to_have_text("2 pages")
    # Images still preview from blob: URLs; the page no longer needs blob: frames.
    with httpx.Client() as client:
        csp = client.get(tenant.controller.url + "/files/").headers["content-security-policy"]
    assert "frame-src 'self'" in csp and "frame-src blob:" not in csp

    # The frame takes focus and keeps the keys; Escape in it closes the preview.
    page.locator(".preview iframe").click()
    frame.wait_for_function("() => document.hasFocus()", timeout=BUSY_MS)
    escape_in_the_frame(page, preview)
    expect(page).not_to_have_url(re.compile("preview="))
    expect(page.get_by_role("link", name="Open report.pdf")).to_be_focused()


def test_the_pdf_frame_is_reached_and_scrolled_from_the_keyboard(
    page: Page, tenant: Tenant
) -> None:
    put_file(tenant, tenant.my_folder, "report.pdf", text_pdf(["One", "Two", "Three"]))
    open_preview(page, tenant, "report.pdf")
    preview = page.locator(".preview")
    frame = viewer_frame(page, "report.pdf")
    wait_for_pages(frame, 3)
    assert axe_violations(page) == []
    frame.evaluate(axe_source() + "\n;undefined")
    inside = frame.evaluate(
        "async () => (await axe.run(document, { resultTypes: ['violations'] })).violations"
        ".filter(v => ['serious', 'critical'].includes(v.impact)).map(v => v.id)"
    )
    assert inside == []

    # Tab from the preview's last button goes into the frame, whose pages
    # scroll with the keys; Escape there closes the preview.
    preview.get_by_role("button", name="Close preview").focus()
    page.keyboard.press("Tab")
    frame.wait_for_function("() => document.activeElement.id === 'pages'", timeout=BUSY_MS)
    page.keyboard.press("PageDown")
    frame.wait_for_function("() => window.scrollY > 0", timeout=BUSY_MS)
    escape_in_the_frame(page, preview)
    expect(page.get_by_role("link", name="Open report.pdf")).to_be_focused()


def test_without_a_worker_pdfjs_draws_in_the_frames_thread(page: Page, tenant: Tenant) -> None:
    # A browser that starts no worker in the frame: pdf.js's worker module
    # then runs in the frame itself, under the same CSP.
    page.add_init_script(
        "if (location.pathname.endsWith('/pdf-viewer.html')) {"
        " window.Worker = function () { throw new DOMException('no', 'SecurityError'); }; }"
    )
    put_file(tenant, tenant.my_folder, "report.pdf", text_pdf(["In thread"]))
    open_preview(page, tenant, "report.pdf")
    frame = viewer_frame(page, "report.pdf")
    wait_for_pages(frame, 1)
    assert frame.evaluate("() => typeof globalThis.pdfjsWorker.WorkerMessageHandler")
    assert not [w.url for w in page.workers if w.url.startswith("blob:null/")], page.workers
    expect(page.locator(".preview").get_by_role("status")).to_have_text("1 page")


def test_only_the_first_pages_of_a_long_pdf_are_drawn(page: Page, tenant: Tenant) -> None:
    put_file(tenant, tenant.my_folder, "long.pdf", text_pdf([f"Page {n}" for n in range(1, 24)]))
    open_preview(page, tenant, "long.pdf")
    frame = viewer_frame(page, "long.pdf")
    pages = wait_for_pages(frame, 20)
    assert [p["label"] for p in pages] == [f"Page {n} of 23" for n in range(1, 21)]
    expect(page.locator(".preview").get_by_role("status")).to_have_text(
        "23 pages; the first 20 are shown here. Download it to see the rest."
    )
    expect(page.locator(".preview").get_by_role("link", name="Download long.pdf")).to_be_visible()


REACH = """
async (controller) => {
  const attempt = (f) => { try { f(); return "allowed"; } catch (e) { return e.name; } };
  const violations = [];
  document.addEventListener("securitypolicyviolation", (e) => violations.push(e.effectiveDirective));
  let fetched;
  try {
    const resp = await fetch(controller + "/files/api/session", { credentials: "include" });
    fetched = "status " + resp.status;
  } catch (e) {
    fetched = e.name;
  }
  // The violation event is queued as a task: let it run.
  await new Promise((resolve) => setTimeout(resolve, 200));
  return {
    origin: window.origin,
    cookie: attempt(() => document.cookie),
    parentDocument: attempt(() => parent.document.title),
    parentStorage: attempt(() => parent.localStorage.length),
    fetched,
    violations,
  };
}
"""
"""From inside the viewer frame: what it can reach of the page, its cookies
and the controller."""


def test_the_viewer_frame_reaches_neither_the_page_nor_the_network(
    page: Page, tenant: Tenant
) -> None:
    controller = tenant.controller
    put_file(tenant, tenant.my_folder, "report.pdf", text_pdf(["Hello sandbox"]))
    open_preview(page, tenant, "report.pdf")
    frame_el = page.locator(".preview iframe")
    expect(frame_el).to_have_count(1, timeout=BUSY_MS)
    tokens = (frame_el.get_attribute("sandbox") or "").split()
    assert "allow-scripts" in tokens and "allow-same-origin" not in tokens, tokens
    frame = viewer_frame(page, "report.pdf")
    wait_for_pages(frame, 1)

    reach = frame.evaluate(REACH, controller.url)
    assert reach["origin"] == "null", reach  # opaque
    assert reach["cookie"] == "SecurityError", reach
    assert reach["parentDocument"] == "SecurityError", reach
    assert reach["parentStorage"] == "SecurityError", reach
    assert reach["fetched"] == "TypeError", reach  # refused before any request
    assert "connect-src" in reach["violations"], reach

    # The viewer's own document says the same, opened on its own too.
    resp = httpx.get(controller.url + "/files/static/pdf-viewer.html", timeout=30)
    csp = resp.headers["content-security-policy"]
    for directive in ("default-src 'none'", "connect-src 'none'", "sandbox allow-scripts"):
        assert directive in csp, csp
    assert "allow-same-origin" not in csp
    # Its scripts are public code that an opaque origin loads with CORS.
    for name in ("pdf-viewer.js", "vendor/pdfjs/pdf.min.mjs", "vendor/pdfjs/pdf.worker.min.mjs"):
        resp = httpx.get(
            f"{controller.url}/files/static/{name}", headers={"Origin": "null"}, timeout=30
        )
        assert resp.status_code == 200, name
        assert resp.headers["access-control-allow-origin"] == "*", name
        assert resp.headers["content-type"].startswith("text/javascript"), name
    # The page's own modules are not offered to other origins.
    resp = httpx.get(f"{controller.url}/files/static/app.js", timeout=30)
    assert "access-control-allow-origin" not in resp.headers


def test_a_pdf_with_javascript_runs_none_of_it(page: Page, tenant: Tenant) -> None:
    controller = tenant.controller
    # The document opens with a script (an alert, then a navigation of the
    # top window to the controller) and also names it in the document's
    # JavaScript name tree, as Acrobat runs both on open.
    script = (
        b"app.alert('pdf script ran'); this.getURL('%s/files/?pdf-script-ran');"
        b" app.launchURL('%s/files/?pdf-script-ran', true);"
        % (controller.url.encode(), controller.url.encode())
    )
    action = b"<< /Type /Action /S /JavaScript /JS (%s) >>" % script
    pdf = text_pdf(
        ["Scripted"],
        catalog_extra=b"/OpenAction %s /Names << /JavaScript << /Names [(open) %s] >> >>"
        % (action, action),
    )
    put_file(tenant, tenant.my_folder, "scripted.pdf", pdf)
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    requests: list[str] = []
    page.context.on("request", lambda r: requests.append(r.url))
    popups: list[Page] = []
    page.context.on("page", lambda p: popups.append(p))

    open_preview(page, tenant, "scripted.pdf")
    frame = viewer_frame(page, "scripted.pdf")
    wait_for_pages(frame, 1)
    expect(page.locator(".preview").get_by_role("status")).to_have_text("1 page")
    page.wait_for_timeout(1_000)  # a script run on open would have run by now
    assert dialogs == []
    assert popups == []
    assert not [u for u in requests if "pdf-script-ran" in u], requests
    assert frame.url.endswith("/files/static/pdf-viewer.html")
    assert "preview=scripted.pdf" in page.url


def test_a_broken_pdf_says_so_in_the_preview(page: Page, tenant: Tenant) -> None:
    put_file(tenant, tenant.my_folder, "broken.pdf", b"%PDF-1.4\nthis is not a PDF at all\n")
    open_preview(page, tenant, "broken.pdf")
    preview = page.locator(".preview")
    expect(preview.get_by_role("alert")).to_have_text(
        "broken.pdf could not be read as a PDF. Download it to open it.", timeout=BUSY_MS
    )
    expect(preview.locator("iframe")).to_have_count(0)
    expect(preview.get_by_role("link", name="Download broken.pdf")).to_be_visible()


def test_the_vendored_pdfjs_files_are_the_ones_its_readme_names() -> None:
    readme = (VENDOR / "README.md").read_text()
    listed = dict(
        re.findall(r"^\| `([^`]+)` \| `package/[^`]+` \| `([0-9a-f]{64})` \|$", readme, re.M)
    )
    kept = {p.name for p in VENDOR.iterdir() if p.name != "README.md"}
    assert set(listed) == kept == {"pdf.min.mjs", "pdf.worker.min.mjs", "LICENSE"}
    for name, digest in listed.items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == digest, name
