// The PDF viewer: pdf.js (vendor/pdfjs/) in the frame the preview makes,
// pdf-viewer.html. The frame is sandboxed ("allow-scripts", never
// "allow-same-origin") and its document's CSP allows no network, so the PDF,
// hostile input, reaches neither the Files page, its cookies nor the
// network: the page fetches the bytes and hands them over with postMessage.
//
// Messages (the page accepts them only from this frame's window):
//   frame -> page  {type: "ready"}                       listening for the PDF
//                  {type: "opened", pages, shown}        drawing `shown` of `pages`
//                  {type: "failed", reason}              "invalid" | "password" | "failed"
//                  {type: "close"}                       Escape pressed in the frame
//   page -> frame  {type: "pdf", bytes: ArrayBuffer}     once, transferred
//
// pdf.js runs with eval off and no PDF scripting, forms, XFA, WebAssembly or
// fetches of its own; its worker starts from a blob: URL made here (see
// startWorker).

import * as pdfjs from "./vendor/pdfjs/pdf.min.mjs";

const MAX_PAGES = 20; // the rest is for the Download button
const MAX_PIXELS = 8 * 1024 * 1024; // device pixels per page's canvas
const MAX_SCALE = 4;
const WORKER_URL = new URL("vendor/pdfjs/pdf.worker.min.mjs", import.meta.url).href;
const NO_WORKER = "pdf-viewer: no worker";
const WORKER_START_MS = 30_000;
// The page's origin: the URL's, since this document's own origin is opaque.
const PAGE_ORIGIN = location.origin;

const pages = document.getElementById("pages");
const status = document.getElementById("status");
let received = false;

function tell(message) {
  parent.postMessage(message, PAGE_ORIGIN);
}

function say(text, cls = "status") {
  status.className = cls;
  status.textContent = text;
}

/**
 * pdf.js's worker, in a thread of its own where this frame may start one.
 * From an opaque origin, Chromium refuses a worker from the controller's URL
 * (SecurityError) and a module worker from a blob: URL (it fails to load),
 * but starts a classic worker from a blob: URL, whose import() loads the
 * worker module with CORS. Failing all that, the worker's code runs in this
 * frame's thread.
 */
async function startWorker() {
  try {
    const url = JSON.stringify(WORKER_URL);
    const wrapper = `import(${url}).catch(() => postMessage("${NO_WORKER}"));`;
    const src = URL.createObjectURL(new Blob([wrapper], { type: "text/javascript" }));
    const worker = new Worker(src);
    URL.revokeObjectURL(src);
    // pdf.js's worker says "ready" first; a wrapper that failed says NO_WORKER.
    const started = await new Promise((resolve) => {
      const timer = setTimeout(() => resolve(false), WORKER_START_MS);
      const first = (event) => {
        clearTimeout(timer);
        resolve(event.data?.action === "ready");
      };
      worker.addEventListener("message", first, { once: true });
      worker.addEventListener("error", () => resolve(false), { once: true });
    });
    if (started) {
      pdfjs.GlobalWorkerOptions.workerPort = worker;
      return;
    }
    worker.terminate();
  } catch {
    // no worker here: the same code runs in this thread below
  }
  // The module sets globalThis.pdfjsWorker, which pdf.js then runs in-thread.
  await import(WORKER_URL);
}

function reasonOf(err) {
  if (err?.name === "PasswordException") return "password";
  if (err?.name === "InvalidPDFException" || err?.name === "FormatError") return "invalid";
  return "failed";
}

/** Draw one page on a canvas as wide as the frame (within the pixel bound). */
async function drawPage(doc, number, count) {
  const page = await doc.getPage(number);
  const base = page.getViewport({ scale: 1 });
  const width = Math.max(100, pages.clientWidth - 24);
  const cssScale = Math.min(width / base.width, MAX_SCALE);
  let scale = cssScale * (window.devicePixelRatio || 1);
  const area = base.width * base.height * scale * scale;
  if (area > MAX_PIXELS) scale = Math.sqrt(MAX_PIXELS / (base.width * base.height));
  const viewport = page.getViewport({ scale });
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, Math.floor(viewport.width));
  canvas.height = Math.max(1, Math.floor(viewport.height));
  canvas.style.width = `${Math.floor(base.width * cssScale)}px`;
  canvas.setAttribute("role", "img");
  canvas.setAttribute("aria-label", `Page ${number} of ${count}`);
  pages.append(canvas);
  await page.render({ canvas, viewport, annotationMode: pdfjs.AnnotationMode.DISABLE }).promise;
  page.cleanup();
}

async function show(bytes) {
  try {
    await startWorker();
  } catch {
    say("The PDF viewer could not start.", "status error");
    tell({ type: "failed", reason: "failed" });
    return;
  }
  const task = pdfjs.getDocument({
    data: new Uint8Array(bytes),
    isEvalSupported: false,
    enableXfa: false,
    useWasm: false,
    useWorkerFetch: false,
    stopAtErrors: false,
  });
  let doc;
  try {
    doc = await task.promise;
  } catch (err) {
    const reason = reasonOf(err);
    say(
      reason === "password"
        ? "This PDF is protected by a password."
        : "This file could not be read as a PDF.",
      "status error",
    );
    tell({ type: "failed", reason });
    return;
  }
  const count = doc.numPages;
  const shown = Math.min(count, MAX_PAGES);
  status.remove();
  tell({ type: "opened", pages: count, shown });
  for (let n = 1; n <= shown; n++) {
    try {
      await drawPage(doc, n, count);
    } catch {
      const note = document.createElement("p");
      note.className = "status error";
      note.textContent = `Page ${n} could not be drawn.`;
      pages.append(note);
    }
  }
}

window.addEventListener("message", (event) => {
  if (event.source !== parent || event.origin !== PAGE_ORIGIN || received) return;
  const data = event.data;
  if (!data || data.type !== "pdf" || !(data.bytes instanceof ArrayBuffer)) return;
  received = true;
  show(data.bytes);
});

// Keys stay in this frame while it has focus: Escape asks the page to close.
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape") {
    event.preventDefault();
    tell({ type: "close" });
  }
});

tell({ type: "ready" });
