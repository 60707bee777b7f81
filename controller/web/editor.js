// The editor view (?edit=path): a UTF-8 text file of at most EDITOR_LIMIT
// bytes, opened from its preview ("Edit") or, in an agent's folder, from
// "Instructions" (the agent's entry file). Larger or binary files are not
// opened: the view offers their download instead.
//
// A save sends X-Base-Digest, the digest of the version the editor loaded
// ("none" for a file that did not exist), so it never replaces a version
// the person has not seen. When someone saved meanwhile (another tab, the
// API, an agent run: run saves are per-file last-sync-wins and do not wait
// for an open editor), the answer is 409 stale_save: the draft stays in the
// editor, the newer saved text is shown beside it, and the person chooses to
// overwrite it with the draft, discard the draft, or copy the draft.

import { ApiError, EDITOR_LIMIT } from "./api.js";
import { confirmAction } from "./dialog.js";
import { baseName, clear, formatSize, h } from "./dom.js";

/** UTF-8 text, or null for bytes that are not (invalid UTF-8 or NUL bytes). */
function decodeText(bytes) {
  const view = new Uint8Array(bytes);
  if (view.includes(0)) return null;
  try {
    return new TextDecoder("utf-8", { fatal: true }).decode(view);
  } catch {
    return null;
  }
}

export class Editor {
  constructor(folder, ids) {
    this.folder = folder;
    this.seq = 0; // discards answers for a file that is no longer open
    this.path = null;
    this.digest = null; // the saved version the draft is based on; null: no file yet
    this.saved = ""; // that version's text, to tell a draft from it
    this.contentType = null;
    this.theirs = null; // {text, digest} of the newer saved version during a conflict
    this.busy = false;
    this.section = this.build(ids);
    this.onUnload = (event) => {
      if (this.dirty()) event.preventDefault();
    };
    window.addEventListener("beforeunload", this.onUnload);
  }

  build(ids) {
    this.heading = h("h2", { id: ids.editor, tabindex: "-1", text: "Edit" });
    this.download = h("a", { class: "button-link small secondary", text: "Download" });
    this.closeButton = h(
      "button",
      { type: "button", class: "small secondary", onClick: () => this.requestClose() },
      "Close editor",
    );
    this.saveButton = h("button", { type: "button", onClick: () => this.save() }, "Save");
    this.label = h("label", { for: ids.editorText, text: "Your text" });
    this.text = h("textarea", {
      id: ids.editorText,
      class: "editor-text",
      spellcheck: "false",
      rows: "18",
    });
    this.text.addEventListener("input", () => this.showDirty());
    this.text.addEventListener("keydown", (event) => {
      // Ctrl+S / Cmd+S saves instead of saving the page.
      if ((event.ctrlKey || event.metaKey) && event.key.toLowerCase() === "s") {
        event.preventDefault();
        this.save();
      }
    });
    this.theirsLabel = h("label", { for: ids.editorTheirs, text: "Saved meanwhile (newer)" });
    this.theirsText = h("textarea", {
      id: ids.editorTheirs,
      class: "editor-text theirs",
      readonly: true,
      rows: "18",
    });
    this.theirsPane = h("div", { class: "editor-pane", hidden: true }, this.theirsLabel, this.theirsText);
    this.conflictHeading = h("h3", { id: ids.editorConflict, tabindex: "-1" });
    this.conflictText = h("p");
    this.overwrite = h(
      "button",
      { type: "button", onClick: () => this.overwriteWithDraft() },
      "Overwrite with my draft",
    );
    this.discard = h(
      "button",
      { type: "button", class: "secondary", onClick: () => this.discardDraft() },
      "Discard my draft",
    );
    this.copy = h(
      "button",
      { type: "button", class: "secondary", onClick: () => this.copyDraft() },
      "Copy my draft",
    );
    this.conflict = h(
      "div",
      { class: "conflict", role: "group", "aria-labelledby": ids.editorConflict, hidden: true },
      this.conflictHeading,
      this.conflictText,
      h("div", { class: "row-actions" }, this.overwrite, this.discard, this.copy),
    );
    this.state = h("p", { class: "muted editor-state", "aria-live": "polite" });
    this.status = h("p", { class: "status", role: "status" });
    this.error = h("p", { class: "error", role: "alert" });
    this.message = h("div", { class: "editor-message" });
    this.body = h(
      "div",
      { class: "editor-body" },
      this.conflict,
      h(
        "div",
        { class: "editor-panes" },
        h("div", { class: "editor-pane" }, this.label, this.text),
        this.theirsPane,
      ),
      h("div", { class: "editor-actions" }, this.saveButton, this.state),
    );
    return h(
      "section",
      { class: "card editor", "aria-labelledby": ids.editor, hidden: true },
      h(
        "div",
        { class: "preview-head" },
        this.heading,
        h("div", { class: "row-actions" }, this.download, this.closeButton),
      ),
      this.message,
      this.body,
      this.status,
      this.error,
    );
  }

  destroy() {
    window.removeEventListener("beforeunload", this.onUnload);
  }

  dirty() {
    return this.path !== null && !this.body.hidden && this.text.value !== this.saved;
  }

  showDirty() {
    if (this.folder.readOnly) return;
    this.state.textContent = this.dirty() ? "Unsaved changes" : "No unsaved changes";
  }

  close() {
    this.seq += 1;
    this.path = null;
    this.theirs = null;
    this.section.hidden = true;
  }

  /** Close, asking first when the draft has unsaved changes. */
  async requestClose() {
    if (this.dirty()) {
      const ok = await confirmAction({
        title: "Discard your changes?",
        message: `Your changes to ${baseName(this.path)} are not saved. Close the editor anyway?`,
        confirmLabel: "Discard changes",
      });
      if (!ok) return;
    }
    this.folder.closeEditor();
  }

  /** Open `path` (from the URL). `create`: a missing file opens empty (the agent's entry). */
  async openPath(path, { create = false } = {}) {
    const seq = ++this.seq;
    const name = baseName(path);
    this.path = path;
    this.theirs = null;
    this.section.hidden = false;
    this.heading.textContent = this.folder.readOnly ? `View: ${name}` : `Edit: ${name}`;
    this.download.href = this.folder.api.contentUrl(path);
    this.download.download = name;
    this.download.setAttribute("aria-label", `Download ${name}`);
    this.status.textContent = "";
    this.error.textContent = "";
    this.showConflict(false);
    this.body.hidden = true;
    this.say("Loading…", "muted");
    this.heading.focus();
    let entry;
    let file;
    try {
      entry = await this.folder.api.entry(path);
      if (entry && entry.kind === "file" && entry.byteSize <= EDITOR_LIMIT) {
        file = await this.folder.api.readFile(path);
      }
    } catch (err) {
      if (seq !== this.seq) return;
      this.say(`Could not open ${name}: ${this.folder.explain(err)}`, "error");
      return;
    }
    if (seq !== this.seq) return;
    if (!entry && !create) {
      this.say(`There is no file ${path} in this folder.`, "error");
      return;
    }
    if (entry && entry.kind !== "file") {
      this.say(`${path} is a folder.`, "error");
      return;
    }
    if (entry && entry.byteSize > EDITOR_LIMIT) {
      this.say(
        `${name} is ${formatSize(entry.byteSize)}, more than the 1 MiB the editor opens. Download it to work on it.`,
        "muted",
      );
      return;
    }
    const text = file ? decodeText(file.bytes) : "";
    if (text === null) {
      this.say(`${name} is not UTF-8 text, so the editor cannot open it. Download it instead.`, "muted");
      return;
    }
    this.contentType = entry ? entry.contentType : null;
    this.load(text, file ? file.digest : null);
    clear(this.message);
    this.body.hidden = false;
    this.text.readOnly = this.folder.readOnly;
    this.saveButton.hidden = this.folder.readOnly;
    if (this.folder.readOnly) this.state.textContent = "Read only: your role does not allow changes.";
    this.text.focus();
  }

  /** Show `text` as the saved version `digest` (null: no file yet) and the draft. */
  load(text, digest) {
    this.saved = text;
    this.digest = digest;
    this.text.value = text;
    this.label.textContent = `Your text of ${baseName(this.path)}`;
    this.showDirty();
  }

  say(text, cls) {
    clear(this.message).append(h("p", { class: cls, role: cls === "error" ? "alert" : null, text }));
  }

  async save() {
    if (this.busy || this.folder.readOnly || this.path === null) return;
    const draft = this.text.value;
    const bytes = new TextEncoder().encode(draft);
    this.error.textContent = "";
    if (bytes.length > EDITOR_LIMIT) {
      this.error.textContent = `The text is ${formatSize(bytes.length)}; the editor saves at most 1 MiB.`;
      return;
    }
    await this.put(bytes, this.digest ?? "new", draft);
  }

  /** PUT `bytes` based on the version `base`; when stale (409) show the conflict, keeping the draft. */
  async put(bytes, base, draft) {
    const seq = this.seq;
    const path = this.path;
    this.busy = true;
    this.saveButton.disabled = true;
    this.status.textContent = "Saving…";
    try {
      const answer = await this.folder.api.saveEdit(path, bytes, {
        base,
        contentType: this.contentType,
      });
      if (seq !== this.seq) return;
      this.theirs = null;
      this.showConflict(false);
      this.saved = draft;
      this.digest = answer.file.digest;
      this.showDirty();
      this.status.textContent = `Saved ${baseName(path)}.`;
      this.folder.refreshSync();
    } catch (err) {
      if (seq !== this.seq) return;
      this.status.textContent = "";
      if (err instanceof ApiError && err.code === "stale_save") {
        await this.conflictFound(seq);
      } else {
        this.error.textContent = `Could not save ${baseName(path)}: ${this.folder.explain(err)}`;
      }
    } finally {
      this.busy = false;
      this.saveButton.disabled = false;
    }
  }

  /** Someone saved (or deleted) the file since it was loaded: fetch what is there now. */
  async conflictFound(seq) {
    let file;
    try {
      file = await this.folder.api.readFile(this.path);
    } catch (err) {
      if (seq !== this.seq) return;
      this.error.textContent = `The file changed, and its newer version could not be loaded: ${this.folder.explain(err)}`;
      return;
    }
    if (seq !== this.seq) return;
    const name = baseName(this.path);
    if (file === null) {
      this.theirs = { text: null, digest: null };
      this.conflictHeading.textContent = `${name} was deleted since you opened it`;
      this.conflictText.textContent =
        "Your draft is kept below. Save it as a new file, discard it, or copy it.";
      this.overwrite.textContent = "Save my draft as a new file";
    } else {
      const text = decodeText(file.bytes);
      this.theirs = { text, digest: file.digest };
      this.conflictHeading.textContent = `${name} changed since you opened it`;
      this.conflictText.textContent =
        "Your draft is kept. The newer saved version is shown beside it: overwrite it with your draft, discard your draft, or copy your draft.";
      this.overwrite.textContent = "Overwrite with my draft";
      this.theirsText.value = text ?? "(The newer version is not text; download it to see it.)";
    }
    this.showConflict(true);
    this.conflictHeading.focus();
  }

  showConflict(on) {
    this.conflict.hidden = !on;
    this.theirsPane.hidden = !on || !this.theirs || this.theirs.text === null;
    this.section.classList.toggle("in-conflict", on);
  }

  async overwriteWithDraft() {
    if (!this.theirs) return;
    const draft = this.text.value;
    await this.put(new TextEncoder().encode(draft), this.theirs.digest ?? "new", draft);
  }

  discardDraft() {
    if (!this.theirs) return;
    if (this.theirs.digest === null) {
      // Nothing to go back to: the file is gone.
      this.saved = this.text.value;
      this.folder.closeEditor();
      return;
    }
    if (this.theirs.text === null) {
      this.error.textContent = "The newer version is not text: download it instead.";
      return;
    }
    this.load(this.theirs.text, this.theirs.digest);
    this.theirs = null;
    this.showConflict(false);
    this.status.textContent = "Your draft was discarded; the editor shows the saved version.";
    this.text.focus();
  }

  async copyDraft() {
    const draft = this.text.value;
    try {
      await navigator.clipboard.writeText(draft);
      this.status.textContent = "Your draft is copied to the clipboard.";
    } catch {
      // No clipboard access (permissions, an insecure origin): select it for Ctrl+C.
      this.text.focus();
      this.text.select();
      this.status.textContent = "Your draft is selected: press Ctrl+C (or Cmd+C) to copy it.";
    }
  }
}
