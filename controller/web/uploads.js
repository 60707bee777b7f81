// Uploads into the folder's current directory: the upload button and its
// "executable" checkbox, the list of uploads with a progress bar each (a
// panel over the page's corner, so it never pushes the listing down), and a
// queue that runs UPLOAD_CONCURRENCY of them at a time. A failed upload stays
// listed with a Retry button that reuses its Idempotency-Key.
//
// No silent overwrites: every upload first goes with `If-None-Match: *`. When
// the name is taken the page asks: Replace (sent again with `If-Match` of the
// file that was there, whose old content the server keeps in the trash),
// Keep both (the next free "name (n).ext") or Skip.

import { ApiError, UPLOAD_LIMIT, newIdempotencyKey } from "./api.js";
import { chooseAction } from "./dialog.js";
import { baseName, carriesFiles, formatSize, h, joinPath, parentDir, plural } from "./dom.js";

const UPLOAD_CONCURRENCY = 3;
const STATE_LABEL = {
  queued: "Waiting",
  uploading: "Uploading",
  done: "Uploaded",
  failed: "Failed",
  skipped: "Skipped",
};

/** "a.txt" -> "a (2).txt" for n = 2; "Makefile" -> "Makefile (2)". */
function numberedName(name, n) {
  const dot = name.lastIndexOf(".");
  return dot > 0 ? `${name.slice(0, dot)} (${n})${name.slice(dot)}` : `${name} (${n})`;
}

export class Uploads {
  constructor(folder, ids) {
    this.folder = folder;
    this.items = [];
    this.active = 0;
    this.asking = Promise.resolve(); // overwrite questions, one at a time

    this.input = h("input", { id: ids.upload, type: "file", multiple: true, hidden: true });
    this.input.addEventListener("change", () => {
      this.enqueue([...this.input.files]);
      this.input.value = "";
    });
    this.execBox = h("input", { id: ids.exec, type: "checkbox", name: "executable" });
    const button = h(
      "button",
      { type: "button", onClick: () => this.input.click() },
      "Upload files…",
    );
    /** The upload button and checkbox, for the files view's toolbar. */
    this.controls = h(
      "div",
      { class: "upload-controls" },
      button,
      this.input,
      h(
        "span",
        { class: "check" },
        this.execBox,
        h("label", { for: ids.exec, text: "Mark uploads as executable" }),
      ),
    );

    this.list = h("ul", { class: "uploads", "aria-label": "Uploads" });
    this.clearButton = h(
      "button",
      { type: "button", class: "link-button", hidden: true, onClick: () => this.clearFinished() },
      "Clear finished uploads",
    );
    /** The list of uploads, for the files view. */
    this.box = h(
      "section",
      { class: "uploads-box", "aria-label": "Uploads", hidden: true },
      this.list,
      this.clearButton,
    );
  }

  abortAll() {
    for (const item of this.items) if (item.abort) item.abort();
  }

  /** Files dropped on `zone` are uploaded to the current directory. */
  acceptDrops(zone) {
    let depth = 0;
    zone.addEventListener("dragenter", (e) => {
      if (!carriesFiles(e)) return;
      e.preventDefault();
      depth += 1;
      zone.classList.add("dragging");
    });
    zone.addEventListener("dragover", (e) => {
      if (!carriesFiles(e)) return;
      e.preventDefault();
      e.dataTransfer.dropEffect = "copy";
    });
    zone.addEventListener("dragleave", () => {
      depth = Math.max(0, depth - 1);
      if (depth === 0) zone.classList.remove("dragging");
    });
    zone.addEventListener("drop", (e) => {
      if (!carriesFiles(e)) return;
      e.preventDefault();
      depth = 0;
      zone.classList.remove("dragging");
      this.enqueue([...e.dataTransfer.files]);
    });
  }

  enqueue(files) {
    if (this.folder.readOnly || !files.length) return;
    const executable = this.execBox.checked;
    for (const file of files) {
      const item = {
        file,
        path: joinPath(this.folder.dir, file.name),
        executable,
        key: newIdempotencyKey(), // kept for retries of this same upload
        condition: "new", // or the digest of the file it may replace
        copy: 0, // the "(n)" of a kept-both copy
        state: "queued",
        abort: null,
      };
      item.el = this.row(item);
      this.items.push(item);
      this.list.append(item.el.li);
    }
    this.box.hidden = false;
    this.folder.announce(`${plural(files.length, "file")} queued for upload.`);
    this.pump();
  }

  row(item) {
    const name = item.file.name;
    const progress = h("progress", {
      max: "100",
      value: "0",
      "aria-label": `Upload progress for ${name}`,
    });
    const state = h("span", { class: "upload-state", text: "Waiting" });
    const error = h("p", { class: "error", role: "alert" });
    const retry = h(
      "button",
      { type: "button", class: "small", hidden: true, "aria-label": `Retry upload of ${name}` },
      "Retry",
    );
    const cancel = h(
      "button",
      { type: "button", class: "small secondary", "aria-label": `Cancel upload of ${name}` },
      "Cancel",
    );
    const remove = h(
      "button",
      {
        type: "button",
        class: "small secondary",
        hidden: true,
        "aria-label": `Remove ${name} from the list`,
      },
      "Remove",
    );
    retry.addEventListener("click", () => {
      item.state = "queued";
      this.updateRow(item);
      this.pump();
    });
    cancel.addEventListener("click", () => {
      if (item.state === "uploading" && item.abort) item.abort();
      else if (item.state === "queued") {
        item.state = "failed";
        item.el.error.textContent = "Upload cancelled.";
        this.updateRow(item);
      }
    });
    remove.addEventListener("click", () => {
      this.items = this.items.filter((u) => u !== item);
      item.el.li.remove();
      this.updateClearButton();
    });
    const nameEl = h("span", { class: "upload-name" }, name);
    const dest = parentDir(item.path);
    const li = h(
      "li",
      { class: "upload" },
      h(
        "div",
        { class: "upload-line" },
        nameEl,
        dest ? h("span", { class: "muted", text: ` → ${dest}/` }) : null,
        h("span", { class: "muted upload-size", text: formatSize(item.file.size) }),
        item.executable ? h("span", { class: "badge", text: "executable" }) : null,
        state,
        retry,
        cancel,
        remove,
      ),
      progress,
      error,
    );
    return { li, progress, state, error, retry, cancel, remove, nameEl };
  }

  updateRow(item) {
    const el = item.el;
    if (item.state !== "uploading" || !el.state.textContent.startsWith("Uploading"))
      el.state.textContent = item.doneText || STATE_LABEL[item.state];
    el.li.dataset.state = item.state;
    el.retry.hidden = item.state !== "failed";
    el.cancel.hidden = !(item.state === "queued" || item.state === "uploading");
    el.remove.hidden = !["failed", "done", "skipped"].includes(item.state);
    // A full bar next to "Failed" would read as success.
    el.progress.hidden = item.state === "failed";
    if (item.state === "queued") {
      el.error.textContent = "";
      el.progress.value = 0;
    }
    this.updateClearButton();
  }

  updateClearButton() {
    this.clearButton.hidden = !this.items.some((u) => u.state === "done" || u.state === "skipped");
    this.box.hidden = !this.items.length;
  }

  clearFinished() {
    const finished = (u) => u.state === "done" || u.state === "skipped";
    for (const item of this.items.filter(finished)) item.el.li.remove();
    this.items = this.items.filter((u) => !finished(u));
    this.updateClearButton();
  }

  /**
   * The name is taken: ask (one question at a time) and set the item up for
   * its next attempt. Returns false when it is skipped.
   */
  async resolveConflict(item, err) {
    const detail = err.details[0] || {};
    if (item.copy) {
      // A numbered copy's name is taken too: try the next number, no question.
      item.copy += 1;
    } else {
      const name = baseName(item.path);
      const where = parentDir(item.path) || "the top of this folder";
      const isFile = Boolean(detail.digest);
      const ask = () =>
        chooseAction({
          title: `${name} already exists`,
          message: isFile
            ? `A file named ${name} is already in ${where}. Replace it (its current content goes to Trash), keep both, or skip this upload?`
            : `A folder named ${name} is already in ${where}. Keep both (the upload gets a numbered name) or skip it?`,
          choices: [
            isFile ? { label: "Replace", value: "replace", class: "danger" } : null,
            { label: "Keep both", value: "keep" },
            { label: "Skip", value: "skip", class: "secondary" },
          ].filter(Boolean),
        });
      const asked = this.asking.then(ask);
      this.asking = asked.catch(() => null);
      const choice = await asked;
      if (choice === "replace") {
        item.condition = detail.digest;
        return true;
      }
      if (choice !== "keep") return false;
      item.copy = 1;
      const known = new Set(this.folder.listing.entries.map((e) => e.path));
      while (known.has(this.copyPath(item))) item.copy += 1;
    }
    item.path = this.copyPath(item);
    item.condition = "new";
    item.key = newIdempotencyKey(); // another request: another key
    item.el.nameEl.textContent = baseName(item.path);
    return true;
  }

  copyPath(item) {
    return joinPath(parentDir(item.path), numberedName(item.file.name, item.copy));
  }

  pump() {
    while (this.active < UPLOAD_CONCURRENCY) {
      const next = this.items.find((u) => u.state === "queued");
      if (!next) return;
      this.run(next);
    }
  }

  async run(item) {
    const { folder } = this;
    item.state = "uploading";
    item.doneText = null;
    this.active += 1;
    this.updateRow(item);
    const el = item.el;
    try {
      if (item.file.size > UPLOAD_LIMIT) {
        throw new ApiError(413, {
          error: "The file is larger than the server accepts (1 GiB per file).",
          code: "payload_too_large",
        });
      }
      const { promise, abort } = folder.api.upload(item.path, item.file, {
        key: item.key,
        executable: item.executable,
        condition: item.condition,
        onProgress: (loaded, total) => {
          const pct = total ? Math.floor((loaded / total) * 100) : 0;
          el.progress.value = pct;
          el.state.textContent = `Uploading ${pct}%`;
        },
      });
      item.abort = abort;
      const result = await promise;
      item.state = "done";
      // A replayed key answers applied=false: the file was already there.
      item.doneText = result && result.applied === false ? "Already uploaded" : "Uploaded";
      if (item.condition !== "new") item.doneText = "Replaced";
      el.progress.value = 100;
      if (result && result.file) folder.listing.upsertEntries([result.file]);
      folder.announce(`${item.doneText}: ${item.file.name}.`);
      folder.refreshSync();
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      if (err.code === "precondition_failed" && item.condition === "new") {
        item.state = (await this.resolveConflict(item, err)) ? "queued" : "skipped";
        if (item.state === "skipped") folder.announce(`Skipped ${item.file.name}.`);
      } else {
        item.state = "failed";
        el.error.textContent = `Could not upload ${item.file.name}: ${folder.explain(err)}`;
        // The file changed again since Replace was chosen: Retry asks anew.
        if (err.code === "precondition_failed") item.condition = "new";
      }
    } finally {
      item.abort = null;
      this.active -= 1;
      if (!folder.destroyed) {
        this.updateRow(item);
        this.pump();
      }
    }
  }
}
