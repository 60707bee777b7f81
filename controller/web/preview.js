// The preview view: one file at a time, as an image, a PDF or UTF-8 text,
// fetched as bytes (at most PREVIEW_LIMIT). It has its own address
// (?preview=path), spans the content column, and "Expand" gives it the
// whole window; Escape or "Close preview" goes back.
//
// What is shown inline follows the controller's allowlist of download types
// (controller/api/objects.py INLINE_TYPES): raster images, PDF, text. An
// image is shown from a blob: URL, which has the page's origin, so its type
// is always one this file chooses from that list, never the type the
// uploader declared: an SVG or HTML blob opened on its own would be a
// document of the Files page's origin.
//
// A PDF is drawn by pdf.js in a frame of its own (pdf-viewer.html and .js),
// sandboxed with "allow-scripts" only, so its document has an opaque origin:
// no cookies, no access to this page, and its CSP allows no network. This
// file hands it the bytes with postMessage (transferred) and takes back only
// the messages of pdf-viewer.js's small protocol, from that frame's window.
// (Chromium's own PDF viewer refuses any sandboxed frame, so it is not used.)

import { ApiError, EDITOR_LIMIT, PREVIEW_LIMIT } from "./api.js";
import { baseName, clear, formatSize, h, isWithin } from "./dom.js";

const IMAGE_EXTENSIONS = {
  png: "image/png",
  jpg: "image/jpeg",
  jpeg: "image/jpeg",
  gif: "image/gif",
  webp: "image/webp",
};
const IMAGE_TYPES = new Set(Object.values(IMAGE_EXTENSIONS));
const PDF_VIEWER = "/files/static/pdf-viewer.html";
const VIEWER_START_MS = 60_000;
const FAILURES = {
  invalid: "could not be read as a PDF.",
  password: "is protected by a password, which the preview does not ask for.",
  failed: "could not be shown as a PDF.",
};

/** A page count from the viewer frame: a whole number from 1 up. */
function pageCount(value) {
  return Number.isSafeInteger(value) && value > 0;
}

function extension(name) {
  const i = name.lastIndexOf(".");
  return i < 0 ? "" : name.slice(i + 1).toLowerCase();
}

/** The stored content type's media type, lower case. */
function mediaType(entry) {
  return (entry.contentType || "").split(";")[0].trim().toLowerCase();
}

/** "image" (raster only) | "pdf" | "other", from the stored content type or the name. */
function previewKind(entry) {
  const type = mediaType(entry);
  const ext = extension(baseName(entry.path));
  if (IMAGE_TYPES.has(type) || IMAGE_EXTENSIONS[ext]) return "image";
  if (type === "application/pdf" || ext === "pdf") return "pdf";
  return "other";
}

/** UTF-8 text, or null when the bytes look binary (NUL bytes or invalid UTF-8). */
function decodeText(bytes) {
  const view = new Uint8Array(bytes);
  if (view.includes(0)) return null;
  try {
    return new TextDecoder("utf-8", { fatal: true }).decode(view);
  } catch {
    return null;
  }
}

export class Preview {
  constructor(folder, ids) {
    this.folder = folder;
    this.seq = 0; // discards answers for a preview that was closed or replaced
    this.url = null; // an image's blob: URL on screen, revoked when it goes
    this.path = null;
    this.releaseFrame = null; // stops listening to the PDF viewer frame
    this.section = this.build(ids);
  }

  build(ids) {
    this.heading = h("h2", { id: ids.preview, tabindex: "-1", text: "Preview" });
    this.body = h("div", { class: "preview-body" });
    this.download = h("a", { class: "button-link small", text: "Download" });
    // Text files the editor can take (at most 1 MiB) get "Edit".
    this.edit = h("a", { class: "button-link small", "data-nav": true, text: "Edit", hidden: true });
    const close = h(
      "button",
      { type: "button", class: "small secondary", onClick: () => this.folder.closePreview() },
      "Close preview",
    );
    this.expand = h(
      "button",
      {
        type: "button",
        class: "small secondary",
        "aria-pressed": "false",
        onClick: () => this.setExpanded(!this.section.classList.contains("expanded")),
      },
      "Expand",
    );
    return h(
      "section",
      { class: "card preview", "aria-labelledby": ids.preview, hidden: true },
      h(
        "div",
        { class: "preview-head" },
        this.heading,
        h("div", { class: "row-actions" }, this.edit, this.download, this.expand, close),
      ),
      this.body,
    );
  }

  setExpanded(on) {
    this.section.classList.toggle("expanded", on);
    this.expand.setAttribute("aria-pressed", String(on));
    this.expand.textContent = on ? "Shrink" : "Expand";
    document.body.classList.toggle("preview-expanded", on);
  }

  revokeUrl() {
    if (this.url) URL.revokeObjectURL(this.url);
    this.url = null;
    this.releaseFrame?.();
    this.releaseFrame = null;
  }

  /**
   * A PDF, drawn in the sandboxed viewer frame from `bytes`. The frame keeps
   * the keys while it has focus (arrows scroll it); Escape in it asks this
   * page to close the preview.
   */
  pdfFrame(name, bytes) {
    const frame = h("iframe", {
      src: PDF_VIEWER,
      sandbox: "allow-scripts",
      title: `Preview of ${name}`,
      class: "pdf",
    });
    const note = h("p", { class: "muted small-text", role: "status", text: "Loading the PDF…" });
    const fail = (text) => clear(this.body).append(h("p", { class: "error", role: "alert", text }));
    let pending = bytes;
    // A frame that never says "ready" (its scripts refused, say) is not a blank preview.
    const stuck = `${name} could not be shown: the PDF viewer did not start. Download it to open it.`;
    const stalled = setTimeout(() => fail(stuck), VIEWER_START_MS);
    const onMessage = (event) => {
      if (event.source !== frame.contentWindow) return;
      const msg = event.data;
      if (!msg || typeof msg !== "object") return;
      if (msg.type === "ready" && pending) {
        clearTimeout(stalled);
        frame.contentWindow.postMessage({ type: "pdf", bytes: pending }, "*", [pending]);
        pending = null;
      } else if (msg.type === "opened" && pageCount(msg.pages) && pageCount(msg.shown)) {
        const pages = `${msg.pages} ${msg.pages === 1 ? "page" : "pages"}`;
        note.textContent =
          msg.shown < msg.pages
            ? `${pages}; the first ${msg.shown} are shown here. Download it to see the rest.`
            : pages;
      } else if (msg.type === "failed" && Object.hasOwn(FAILURES, msg.reason)) {
        fail(`${name} ${FAILURES[msg.reason]} Download it to open it.`);
      } else if (msg.type === "close") {
        this.folder.closePreview();
      }
    };
    window.addEventListener("message", onMessage);
    this.releaseFrame = () => {
      clearTimeout(stalled);
      window.removeEventListener("message", onMessage);
    };
    return [frame, note];
  }

  close() {
    this.seq += 1;
    this.revokeUrl();
    this.path = null;
    this.section.hidden = true;
    this.setExpanded(false);
    clear(this.body);
  }

  /** Close the preview if it shows `path` or something below it (it was deleted or moved). */
  closeIfWithin(path) {
    if (this.path && isWithin(this.path, path)) this.folder.closePreview();
  }

  /** Open `path` (from the URL); `entry` when the listing has it, else it is looked up. */
  async openPath(path, entry) {
    const seq = ++this.seq;
    this.path = path;
    this.section.hidden = false;
    this.heading.textContent = `Preview: ${baseName(path)}`;
    this.heading.focus();
    if (!entry) {
      clear(this.body).append(h("p", { class: "muted", text: "Loading preview…" }));
      try {
        entry = await this.folder.api.entry(path);
      } catch (err) {
        if (seq !== this.seq) return;
        clear(this.body).append(
          h("p", { class: "error", role: "alert", text: `Could not load the preview: ${this.folder.explain(err)}` }),
        );
        return;
      }
      if (seq !== this.seq) return;
      if (!entry || entry.kind !== "file") {
        clear(this.body).append(
          h("p", { class: "error", role: "alert", text: `There is no file ${path} in this folder.` }),
        );
        return;
      }
    }
    await this.open(entry, seq);
  }

  async open(entry, seq) {
    const name = baseName(entry.path);
    const { api } = this.folder;
    this.revokeUrl();
    this.heading.textContent = `Preview: ${name}`;
    this.download.href = api.contentUrl(entry.path);
    this.download.download = name;
    this.download.setAttribute("aria-label", `Download ${name}`);
    this.edit.hidden = true;
    this.edit.href = this.folder.editUrl(entry.path);
    this.edit.setAttribute("aria-label", `Edit ${name}`);
    const say = (text, cls = "muted") => clear(this.body).append(h("p", { class: cls, text }));
    this.heading.focus();
    if (entry.byteSize > PREVIEW_LIMIT) {
      say(
        `${name} is ${formatSize(entry.byteSize)}, larger than the 8 MiB preview limit. Download it to open it.`,
      );
      return;
    }
    say("Loading preview…");
    let bytes;
    try {
      bytes = await api.previewBytes(entry.path);
    } catch (err) {
      if (seq !== this.seq) return;
      if (err instanceof ApiError && err.status === 413) {
        say(`${name} is larger than the 8 MiB preview limit. Download it to open it.`);
      } else {
        clear(this.body).append(
          h("p", {
            class: "error",
            role: "alert",
            text: `Could not load the preview: ${this.folder.explain(err)}`,
          }),
        );
      }
      return;
    }
    if (seq !== this.seq) return;
    this.show(entry, name, bytes, say);
  }

  show(entry, name, bytes, say) {
    const kind = previewKind(entry);
    if (kind === "image") {
      const declared = mediaType(entry);
      const type = IMAGE_TYPES.has(declared) ? declared : IMAGE_EXTENSIONS[extension(name)];
      this.url = URL.createObjectURL(new Blob([bytes], { type }));
      const img = h("img", { src: this.url, alt: `Preview of ${name}` });
      img.addEventListener("error", () =>
        say(`${name} could not be shown as an image. Download it to open it.`),
      );
      clear(this.body).append(img);
    } else if (kind === "pdf") {
      clear(this.body).append(...this.pdfFrame(name, bytes));
    } else {
      const text = decodeText(bytes);
      this.edit.hidden = text === null || this.folder.readOnly || bytes.byteLength > EDITOR_LIMIT;
      if (text === null) {
        say(
          `${name} is not text, an image or a PDF, so it can't be shown here. Download it to open it.`,
        );
      } else if (!text.length) {
        say(`${name} is empty.`);
      } else {
        clear(this.body).append(
          h("pre", {
            class: "text-preview",
            tabindex: "0",
            "aria-label": `Contents of ${name}`,
            text,
          }),
        );
      }
    }
  }
}
