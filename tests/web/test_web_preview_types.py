"""The Files page's previews follow the download allowlist: a blob the page
makes (of the page's own origin) is only ever a raster image, a PDF or text,
typed by the page, never by the uploader; and a PDF is drawn from its bytes
by the sandboxed PDF viewer, whatever its declared type."""

from __future__ import annotations

from playwright.sync_api import Page, expect

from tests.support.browser import BROWSER_TESTS
from tests.support.controller import Tenant
from tests.support.web import folder_url, png_bytes, sign_in
from tests.web.test_web_ui import minimal_pdf

pytestmark = BROWSER_TESTS

SVG = b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>'


def put_typed(tenant: Tenant, path: str, data: bytes, declared: str) -> None:
    with tenant.client() as c:
        r = c.put(
            tenant.my_folder + "/content",
            params={"path": path},
            content=data,
            headers={"Content-Type": "application/octet-stream", "X-File-Content-Type": declared},
        )
        assert r.status_code == 201, r.text


RECORD_BLOBS = """
window.blobTypes = {};
const made = URL.createObjectURL;
URL.createObjectURL = (blob) => {
  const url = made.call(URL, blob);
  window.blobTypes[url] = blob.type;
  return url;
};
"""
"""Records the type of each blob: URL the page makes (the page's CSP keeps a
test from fetching one back)."""


def blob_type(page: Page, selector: str, attribute: str) -> str:
    """The type of the blob a preview element shows, as the page made it."""
    return str(
        page.evaluate(
            "([sel, attr]) => window.blobTypes[document.querySelector(sel).getAttribute(attr)]",
            [selector, attribute],
        )
    )


def test_previews_type_their_blobs_from_the_allowlist(page: Page, tenant: Tenant) -> None:
    put_typed(tenant, "drawing.svg", SVG, "image/svg+xml")
    put_typed(tenant, "pixel.png", png_bytes(2, 2, (0, 128, 255)), "image/svg+xml")
    put_typed(tenant, "report.pdf", minimal_pdf("Hello PDF"), "text/html")
    page.add_init_script(RECORD_BLOBS)
    sign_in(page, tenant.controller.url, tenant.token, folder_url(tenant, "user", tenant.user_id))
    preview = page.locator(".preview")

    # An SVG is no image here: its source is shown as text, never rendered.
    page.get_by_role("link", name="Open drawing.svg").click()
    expect(preview.get_by_label("Contents of drawing.svg")).to_contain_text("<script>")
    expect(preview.locator("img")).to_have_count(0)

    # A PNG declared as SVG is shown as the PNG its name says, typed image/png.
    page.get_by_role("link", name="Open pixel.png").press("Enter")
    expect(preview.get_by_role("img", name="Preview of pixel.png")).to_be_visible()
    assert blob_type(page, ".preview img", "src") == "image/png"

    # A PDF declared as HTML is drawn by the PDF viewer's frame all the same,
    # from bytes handed to it: no blob: URL is made for it.
    page.get_by_role("link", name="Open report.pdf").press("Enter")
    frame = preview.locator("iframe[title='Preview of report.pdf']")
    expect(frame).to_be_visible()
    assert frame.get_attribute("src") == "/files/static/pdf-viewer.html"
    pdf_page = page.frame_locator(".preview iframe").get_by_role("img", name="Page 1 of 1")
    expect(pdf_page).to_be_visible(timeout=120_000)
    assert "application/pdf" not in page.evaluate("Object.values(window.blobTypes)")
