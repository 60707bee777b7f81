// One work folder: listing, uploads, previews, trash and sync state.
//
// The listing shows the direct children of one directory. At most
// PAGE_SIZE rows are in the document at any time, whatever the folder holds:
// laying out a table of ten thousand rows takes seconds, two hundred rows
// take milliseconds. Entries arrive from the API a page at a time, in the
// server's order (by name, byte order), and later pages are fetched only when
// the user pages forward. Sorting by a column needs every entry, so the first
// click on a header of a partly loaded folder loads the rest first.

import {
  ApiError,
  FolderApi,
  PAGE_SIZE,
  PREVIEW_LIMIT,
  UPLOAD_LIMIT,
  newIdempotencyKey,
} from "./api.js";
import { confirmAction } from "./dialog.js";
import {
  baseName,
  clear,
  formatSize,
  h,
  isWithin,
  joinPath,
  parentDir,
  timeElement,
  uid,
} from "./dom.js";

export const SCOPES = ["task", "agent", "user", "project"];

// Shown for a missing folder and for one the user may not see, alike: the
// API answers both with the same 404 so that folders cannot be probed, and
// the page must not undo that by rendering them differently.
const NOT_FOUND_TEXT = "This folder doesn't exist or you don't have access";

const SCOPE_LABEL = { task: "Task", agent: "Agent", project: "Project", user: "User" };
const SORT_LABEL = { name: "Name", size: "Size", modified: "Modified", executable: "Executable" };
const RUN_STATE_LABEL = {
  starting: "Starting",
  saving: "Saving",
  saved: "Saved",
  failed: "Save failed",
};
const UPLOAD_CONCURRENCY = 3;
const SYNC_POLL_MS = 15000;

const IMAGE_EXTENSIONS = {
  png: "image/png",
  jpg: "image/jpeg",
  jpeg: "image/jpeg",
  gif: "image/gif",
  webp: "image/webp",
  bmp: "image/bmp",
  svg: "image/svg+xml",
  avif: "image/avif",
  ico: "image/x-icon",
};

function extension(name) {
  const i = name.lastIndexOf(".");
  return i < 0 ? "" : name.slice(i + 1).toLowerCase();
}

/** "image" | "pdf" | "other", from the stored content type or the name. */
function previewKind(entry) {
  const type = (entry.contentType || "").split(";")[0].trim().toLowerCase();
  const ext = extension(baseName(entry.path));
  if (type.startsWith("image/") || IMAGE_EXTENSIONS[ext]) return "image";
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

const NAME_ORDER = new Intl.Collator(undefined, { numeric: true, sensitivity: "base" });

function entriesText(n) {
  return n === 1 ? "1 entry" : `${n.toLocaleString()} entries`;
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

export class FolderPage {
  constructor(root, route, { session, navigate, directoryFor, validScope }) {
    this.root = root;
    this.route = route;
    this.session = session;
    this.navigate = navigate;
    this.directoryFor = directoryFor;
    this.validScope = validScope;
    this.api = new FolderApi(route.companyId, route.scope, route.ownerId);
    this.company = session.companies.find((c) => c.id === route.companyId) || null;
    this.readOnly = !this.company || this.company.role === "viewer";
    this.destroyed = false;

    this.dir = route.dir;
    this.view = route.view;
    this.entries = [];
    this.rowCache = new Map(); // path -> {entry, tr}: rows are rebuilt only when their entry changes
    this.cursor = null;
    this.filesLoadedFor = null; // dir whose listing is in this.entries
    this.listSeq = 0; // discards answers to superseded listing requests
    this.sort = null; // null: the server's order, until a header is clicked
    this.sorted = null; // this.entries in display order; null when stale
    this.pageStart = 0; // index in the display order of the first row shown

    this.trashEntries = [];
    this.trashCursor = null;
    this.trashStart = 0; // index of the first batch shown
    this.trashSeq = 0;

    this.uploads = [];
    this.activeUploads = 0;

    this.previewSeq = 0;
    this.previewUrl = null;
    this.previewOpener = null;

    this.agentNames = new Map();
    this.ownerName = null;
    this.syncTimer = null;
  }

  sameFolder(route) {
    return (
      route.companyId === this.route.companyId &&
      route.scope === this.route.scope &&
      route.ownerId === this.route.ownerId
    );
  }

  destroy() {
    this.destroyed = true;
    clearInterval(this.syncTimer);
    this.revokePreviewUrl();
    for (const item of this.uploads) if (item.abort) item.abort();
  }

  dirUrl(dir) {
    const base = location.pathname;
    return dir ? `${base}?${new URLSearchParams({ dir })}` : base;
  }

  trashUrl() {
    return `${location.pathname}?view=trash`;
  }

  explain(err) {
    if (!(err instanceof ApiError)) throw err;
    return err.code === "not_found" ? NOT_FOUND_TEXT : err.message;
  }

  // --- start-up -------------------------------------------------------------

  async start() {
    document.title = "Files";
    clear(this.root).append(h("p", { class: "muted", role: "status", text: "Loading folder…" }));
    if (!this.validScope) {
      this.renderNotFound();
      return;
    }
    let first;
    try {
      first =
        this.view === "trash"
          ? await this.api.list({ trash: true })
          : await this.api.list({ dir: this.dir });
    } catch (err) {
      if (this.destroyed) return;
      if (!(err instanceof ApiError)) throw err;
      // A malformed address (bad UUID, bad dir) is as unreachable as a
      // missing folder; a 401 has already switched to the sign-in form.
      if (err.status === 404 || (err.status === 400 && !this.dir)) this.renderNotFound();
      else if (err.status !== 401) this.renderLoadError(err);
      return;
    }
    if (this.destroyed) return;
    this.buildSkeleton();
    if (this.view === "trash") {
      this.acceptTrashPage(first, true);
      this.trashFresh = true;
    } else this.acceptFilesPage(first, this.dir, true);
    this.renderFilesUpdated(first.lastOperationAt);
    this.applyView(false);
    this.resolveNames();
    this.refreshSync();
    this.syncTimer = setInterval(() => {
      if (!document.hidden) this.refreshSync();
    }, SYNC_POLL_MS);
  }

  renderNotFound() {
    document.title = "Folder not found · Files";
    clear(this.root).append(
      h("h1", { tabindex: "-1", text: "Folder not found" }),
      h("p", { class: "error", role: "alert", text: NOT_FOUND_TEXT }),
      h("p", {}, h("a", { href: "/files/", "data-nav": true, text: "Go to your files" })),
    );
  }

  renderLoadError(err) {
    clear(this.root).append(
      h("h1", { tabindex: "-1", text: "Files" }),
      h("p", { class: "error", role: "alert", text: `Could not load this folder: ${err.message}` }),
      h("p", {}, h("button", { type: "button", onClick: () => this.start() }, "Try again")),
    );
  }

  /** Display names for the owner and the agents in the sync panel. */
  async resolveNames() {
    const { scope, ownerId, companyId } = this.route;
    let directory = null;
    try {
      directory = await this.directoryFor(companyId);
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
    }
    if (this.destroyed) return;
    if (directory) {
      for (const agent of directory.agents) this.agentNames.set(agent.id, agent.name);
    }
    let name = null;
    if (scope === "user") {
      name = ownerId === this.session.userId ? "My files" : "User files";
    } else if (directory) {
      const list = { task: directory.tasks, agent: directory.agents, project: directory.projects }[
        scope
      ];
      const item = list.find((x) => x.id === ownerId);
      if (item) name = item.title || item.name;
    }
    this.ownerName = name;
    this.renderTitle();
    this.renderBreadcrumbs();
    if (this.lastSync) this.renderSync(this.lastSync);
  }

  // --- layout ---------------------------------------------------------------

  buildSkeleton() {
    const ids = {
      title: uid("folder-title"),
      files: uid("files-heading"),
      trash: uid("trash-heading"),
      sync: uid("sync-heading"),
      preview: uid("preview-heading"),
      exec: uid("exec"),
      folderName: uid("folder-name"),
      upload: uid("upload-input"),
    };
    this.ids = ids;

    this.titleEl = h("h1", { id: ids.title, tabindex: "-1" });
    this.subtitleEl = h("p", { class: "muted subtitle" });
    this.status = h("p", { class: "status", role: "status", "aria-live": "polite" });

    this.filesTab = h("a", { href: this.dirUrl(""), "data-nav": true }, "Files");
    this.trashTab = h("a", { href: this.trashUrl(), "data-nav": true }, "Trash");
    const tabs = h(
      "nav",
      { class: "tabs", "aria-label": "Folder views" },
      h("ul", {}, h("li", {}, this.filesTab), h("li", {}, this.trashTab)),
    );

    this.filesSection = this.buildFilesSection(ids);
    this.trashSection = this.buildTrashSection(ids);
    this.syncSection = this.buildSyncSection(ids);
    this.previewSection = this.buildPreviewSection(ids);

    clear(this.root).append(
      h("div", { class: "folder-head" }, this.titleEl, this.subtitleEl),
      tabs,
      this.status,
      h(
        "div",
        { class: "layout" },
        h("div", { class: "primary" }, this.filesSection, this.trashSection),
        h("div", { class: "secondary-col" }, this.previewSection, this.syncSection),
      ),
    );
    this.renderTitle();
  }

  renderTitle() {
    const { scope, ownerId } = this.route;
    const label = SCOPE_LABEL[scope];
    let title;
    if (scope === "user") title = this.ownerName || "User files";
    else title = this.ownerName ? `${label}: ${this.ownerName}` : `${label} files`;
    this.titleEl.textContent = title;
    const companyName = this.company ? this.company.name : "";
    const parts = [companyName, `${label.toLowerCase()} folder`, ownerId].filter(Boolean);
    this.subtitleEl.textContent = parts.join(" · ");
    document.title = `${title} · Files`;
  }

  announce(text) {
    this.status.textContent = text;
  }

  /** Called on in-page navigation within this folder (dir or view change). */
  show(route) {
    this.route = route;
    if (!this.filesSection) {
      // The folder never loaded (not found, or an error): try afresh.
      this.dir = route.dir;
      this.view = route.view;
      this.start();
      return;
    }
    // The trash URL names no directory; the files view keeps its own.
    const dirChanged = route.view === "files" && route.dir !== this.dir;
    const viewChanged = route.view !== this.view;
    if (route.view === "files") this.dir = route.dir;
    this.view = route.view;
    this.announce("");
    this.applyView(dirChanged || viewChanged);
  }

  applyView(moveFocus) {
    const trash = this.view === "trash";
    this.filesSection.hidden = trash;
    this.trashSection.hidden = !trash;
    this.filesTab.setAttribute("href", this.dirUrl(this.dir));
    if (trash) {
      this.trashTab.setAttribute("aria-current", "page");
      this.filesTab.removeAttribute("aria-current");
      // The first page may have just arrived with the page itself.
      if (this.trashFresh) this.trashFresh = false;
      else this.reloadTrash();
    } else {
      this.filesTab.setAttribute("aria-current", "page");
      this.trashTab.removeAttribute("aria-current");
      this.renderBreadcrumbs();
      if (this.filesLoadedFor !== this.dir) this.reloadFiles();
    }
    // Keyboard and screen reader users land where the new content starts.
    if (moveFocus)
      (trash ? this.trashHeading : this.crumbs.querySelector("[aria-current]")).focus();
  }

  // --- files view -----------------------------------------------------------

  buildFilesSection(ids) {
    this.filesHeading = h("h2", { id: ids.files, class: "sr-only", tabindex: "-1", text: "Files" });
    this.crumbs = h("nav", { class: "crumbs", "aria-label": "Folder path" });

    this.uploadInput = h("input", { id: ids.upload, type: "file", multiple: true, hidden: true });
    this.uploadInput.addEventListener("change", () => {
      this.enqueueUploads([...this.uploadInput.files]);
      this.uploadInput.value = "";
    });
    this.execBox = h("input", { id: ids.exec, type: "checkbox", name: "executable" });
    const uploadButton = h(
      "button",
      { type: "button", onClick: () => this.uploadInput.click() },
      "Upload files…",
    );
    this.folderNameInput = h("input", {
      id: ids.folderName,
      name: "folder-name",
      type: "text",
      autocomplete: "off",
      spellcheck: "false",
    });
    this.folderError = h("p", { class: "error", role: "alert" });
    const folderForm = h(
      "form",
      { class: "new-folder" },
      h("label", { for: ids.folderName, text: "New folder" }),
      this.folderNameInput,
      h("button", { type: "submit" }, "Create folder"),
    );
    folderForm.addEventListener("submit", (e) => {
      e.preventDefault();
      this.createFolder(folderForm.querySelector("button"));
    });

    const toolbar = this.readOnly
      ? h("p", { class: "muted", text: "You have view-only access to this folder." })
      : h(
          "div",
          { class: "toolbar" },
          h(
            "div",
            { class: "upload-controls" },
            uploadButton,
            this.uploadInput,
            h(
              "span",
              { class: "check" },
              this.execBox,
              h("label", { for: ids.exec, text: "Mark uploads as executable" }),
            ),
          ),
          folderForm,
        );

    this.uploadList = h("ul", { class: "uploads", "aria-label": "Uploads" });
    this.clearUploadsButton = h(
      "button",
      {
        type: "button",
        class: "link-button",
        hidden: true,
        onClick: () => this.clearFinishedUploads(),
      },
      "Clear finished uploads",
    );

    this.tbody = h("tbody");
    this.sortButtons = {};
    const header = (key, cls = "") => {
      const button = h(
        "button",
        { type: "button", class: "sort", onClick: () => this.toggleSort(key) },
        SORT_LABEL[key],
        h("span", { class: "sort-indicator", "aria-hidden": "true" }),
      );
      this.sortButtons[key] = button;
      return h("th", { scope: "col", class: cls }, button);
    };
    this.caption = h("caption", { class: "sr-only" });
    this.table = h(
      "table",
      { class: "listing" },
      this.caption,
      h(
        "thead",
        {},
        h(
          "tr",
          {},
          header("name", "col-name"),
          header("size", "col-size"),
          header("modified", "col-modified"),
          header("executable", "col-exec"),
          h("th", { scope: "col", class: "col-actions", text: "Actions" }),
        ),
      ),
      this.tbody,
    );

    this.dropHint = h("p", { class: "drop-hint muted" });
    this.dropZone = h(
      "div",
      { class: "dropzone" },
      this.dropHint,
      h("div", { class: "table-scroll" }, this.table),
    );
    if (!this.readOnly) this.wireDropZone(this.dropZone);

    this.listSummary = h("p", { class: "muted list-summary", "aria-live": "polite" });
    this.prevButton = h(
      "button",
      { type: "button", class: "secondary", onClick: () => this.turnPage(-1) },
      "Previous page",
    );
    this.nextButton = h(
      "button",
      { type: "button", class: "secondary", onClick: () => this.turnPage(1) },
      "Next page",
    );
    this.pager = h("div", { class: "pager", hidden: true }, this.prevButton, this.nextButton);
    this.listError = h("p", { class: "error", role: "alert" });

    return h(
      "section",
      { class: "files-view", "aria-labelledby": ids.files },
      this.filesHeading,
      this.crumbs,
      toolbar,
      this.folderError,
      h("div", { class: "uploads-box" }, this.uploadList, this.clearUploadsButton),
      this.dropZone,
      h("div", { class: "list-footer" }, this.listSummary, this.pager),
      this.listError,
    );
  }

  wireDropZone(zone) {
    let depth = 0;
    const hasFiles = (e) => e.dataTransfer && [...e.dataTransfer.types].includes("Files");
    zone.addEventListener("dragenter", (e) => {
      if (!hasFiles(e)) return;
      e.preventDefault();
      depth += 1;
      zone.classList.add("dragging");
    });
    zone.addEventListener("dragover", (e) => {
      if (!hasFiles(e)) return;
      e.preventDefault();
      e.dataTransfer.dropEffect = "copy";
    });
    zone.addEventListener("dragleave", () => {
      depth = Math.max(0, depth - 1);
      if (depth === 0) zone.classList.remove("dragging");
    });
    zone.addEventListener("drop", (e) => {
      if (!hasFiles(e)) return;
      e.preventDefault();
      depth = 0;
      zone.classList.remove("dragging");
      this.enqueueUploads([...e.dataTransfer.files]);
    });
  }

  renderBreadcrumbs() {
    if (!this.crumbs) return;
    const rootLabel = this.ownerName || `${SCOPE_LABEL[this.route.scope]} folder`;
    const items = [{ label: rootLabel, dir: "" }];
    if (this.dir) {
      const parts = this.dir.split("/");
      parts.forEach((part, i) => items.push({ label: part, dir: parts.slice(0, i + 1).join("/") }));
    }
    const list = h("ol");
    items.forEach((item, i) => {
      const last = i === items.length - 1;
      list.append(
        h(
          "li",
          {},
          last
            ? h("span", { "aria-current": "location", tabindex: "-1", text: item.label })
            : h("a", { href: this.dirUrl(item.dir), "data-nav": true, text: item.label }),
        ),
      );
    });
    clear(this.crumbs).append(list);
    this.caption.textContent = this.dir ? `Contents of ${this.dir}` : `Contents of ${rootLabel}`;
    this.dropHint.textContent = `Drop files here to upload them to ${this.dir || "the top of this folder"}.`;
  }

  async reloadFiles() {
    const dir = this.dir;
    const seq = ++this.listSeq;
    this.listError.textContent = "";
    this.tbody.setAttribute("aria-busy", "true");
    try {
      const page = await this.api.list({ dir });
      if (seq !== this.listSeq || this.destroyed) return;
      this.acceptFilesPage(page, dir, true);
      this.renderFilesUpdated(page.lastOperationAt);
    } catch (err) {
      if (seq !== this.listSeq || this.destroyed) return;
      this.listError.textContent = `Could not load this directory: ${this.explain(err)}`;
    } finally {
      if (seq === this.listSeq) this.tbody.removeAttribute("aria-busy");
    }
  }

  /** Fetch the next API page of this directory; false when it failed. */
  async fetchMoreFiles({ render = true } = {}) {
    const dir = this.dir;
    const seq = this.listSeq;
    this.listError.textContent = "";
    try {
      const page = await this.api.list({ dir, cursor: this.cursor });
      if (seq !== this.listSeq || this.destroyed) return false;
      this.acceptFilesPage(page, dir, false, render);
      return true;
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      this.listError.textContent = `Could not load more entries: ${this.explain(err)}`;
      return false;
    }
  }

  async turnPage(step) {
    const target = this.pageStart + step * PAGE_SIZE;
    if (target < 0) return;
    this.prevButton.disabled = this.nextButton.disabled = true;
    try {
      if (target >= this.entries.length && this.cursor && !(await this.fetchMoreFiles())) return;
      if (target >= this.displayOrder().length) return;
      this.pageStart = target;
    } finally {
      this.renderRows();
    }
  }

  /** Everything left in this directory; used before sorting by a column. */
  async fetchAllFiles() {
    this.listSummary.textContent = "Loading all entries to sort them…";
    while (this.cursor) {
      // One render at the end: each intermediate one would cost a layout.
      if (!(await this.fetchMoreFiles({ render: false }))) {
        this.renderRows();
        return false;
      }
    }
    return true;
  }

  acceptFilesPage(page, dir, reset, render = true) {
    if (reset) {
      this.entries = [];
      this.rowCache.clear();
      this.pageStart = 0;
      this.sort = page.nextCursor ? null : { key: "name", ascending: true };
    }
    // An upload may already have placed an entry that a later page repeats.
    const known = new Set(this.entries.map((e) => e.path));
    for (const entry of page.entries) if (!known.has(entry.path)) this.entries.push(entry);
    this.cursor = page.nextCursor;
    this.filesLoadedFor = dir;
    this.sorted = null;
    if (render) this.renderRows();
  }

  async toggleSort(key) {
    if (this.cursor && !(await this.fetchAllFiles())) return;
    const current = this.sort || { key: "name", ascending: true };
    this.sort =
      current.key === key ? { key, ascending: !current.ascending } : { key, ascending: true };
    this.sorted = null;
    this.pageStart = 0;
    this.renderRows();
    const sortName = SORT_LABEL[key].toLowerCase();
    this.announce(`Sorted by ${sortName}, ${this.sort.ascending ? "ascending" : "descending"}.`);
  }

  /** Loaded entries in display order (cached until entries or sort change). */
  displayOrder() {
    if (!this.sorted) this.sorted = this.sort ? this.sortedEntries() : [...this.entries];
    return this.sorted;
  }

  sortedEntries() {
    const { key, ascending } = this.sort;
    const value = {
      name: () => 0,
      size: (e) => e.byteSize || 0,
      modified: (e) => Date.parse(e.updatedAt) || 0,
      executable: (e) => (e.executable ? 1 : 0),
    }[key];
    // Keys are computed once per entry, not once per comparison.
    const items = this.entries.map((entry) => ({
      entry,
      dir: entry.kind === "directory" ? 0 : 1,
      name: baseName(entry.path),
      value: value(entry),
    }));
    const sign = ascending ? 1 : -1;
    const byName = (a, b) =>
      NAME_ORDER.compare(a.name, b.name) ||
      (a.entry.path < b.entry.path ? -1 : a.entry.path > b.entry.path ? 1 : 0);
    items.sort((a, b) => {
      // Directories stay above files whichever way the column is sorted.
      if (a.dir !== b.dir) return a.dir - b.dir;
      return (a.value - b.value || byName(a, b)) * sign;
    });
    return items.map((item) => item.entry);
  }

  renderRows() {
    const sort = this.sort || { key: "name", ascending: true };
    for (const [key, button] of Object.entries(this.sortButtons)) {
      const th = button.parentElement;
      const indicator = button.querySelector(".sort-indicator");
      if (key === sort.key) {
        th.setAttribute("aria-sort", sort.ascending ? "ascending" : "descending");
        indicator.textContent = sort.ascending ? " ▲" : " ▼";
      } else {
        th.removeAttribute("aria-sort");
        indicator.textContent = "";
      }
    }
    const order = this.displayOrder();
    const total = order.length;
    if (this.pageStart >= total)
      this.pageStart = Math.max(0, Math.floor((total - 1) / PAGE_SIZE) * PAGE_SIZE);
    const shown = order.slice(this.pageStart, this.pageStart + PAGE_SIZE);
    const fragment = document.createDocumentFragment();
    for (const entry of shown) fragment.append(this.rowFor(entry));
    if (!total) {
      fragment.append(
        h(
          "tr",
          { class: "empty" },
          h("td", {
            colspan: "5",
            text: this.readOnly
              ? "This directory is empty."
              : "This directory is empty. Drop files here or use Upload files.",
          }),
        ),
      );
    }
    this.tbody.replaceChildren(fragment);

    const paged = total > PAGE_SIZE || Boolean(this.cursor);
    this.pager.hidden = !paged;
    this.prevButton.disabled = this.pageStart === 0;
    this.nextButton.disabled = this.pageStart + PAGE_SIZE >= total && !this.cursor;
    if (!total) this.listSummary.textContent = "";
    else if (!paged) this.listSummary.textContent = `${entriesText(total)}.`;
    else {
      const first = (this.pageStart + 1).toLocaleString();
      const range = `${first}–${(this.pageStart + shown.length).toLocaleString()}`;
      this.listSummary.textContent = this.cursor
        ? `Showing ${range} of the first ${entriesText(total)}; this directory has more.`
        : `Showing ${range} of ${entriesText(total)}.`;
    }
  }

  rowFor(entry) {
    const cached = this.rowCache.get(entry.path);
    if (cached && cached.entry === entry) return cached.tr;
    const tr = this.buildRow(entry);
    this.rowCache.set(entry.path, { entry, tr });
    return tr;
  }

  buildRow(entry) {
    const name = baseName(entry.path);
    const isDir = entry.kind === "directory";
    const error = h("p", { class: "error row-error", role: "alert" });
    const nameCell = h(
      "th",
      { scope: "row", class: "col-name" },
      isDir
        ? h(
            "a",
            { href: this.dirUrl(entry.path), "data-nav": true, class: "entry-name dir" },
            h("span", { class: "icon icon-dir", "aria-hidden": "true" }),
            `${name}/`,
          )
        : h(
            "span",
            { class: "entry-name file" },
            h("span", { class: "icon icon-file", "aria-hidden": "true" }),
            name,
          ),
    );
    const actions = h("div", { class: "row-actions" });
    if (!isDir) {
      const preview = h(
        "button",
        { type: "button", class: "small", "aria-label": `Preview ${name}` },
        "Preview",
      );
      preview.addEventListener("click", () => this.openPreview(entry, preview));
      actions.append(
        preview,
        h("a", {
          class: "button-link small",
          href: this.api.contentUrl(entry.path),
          download: name,
          "aria-label": `Download ${name}`,
          text: "Download",
        }),
      );
    }
    if (!this.readOnly) {
      const del = h(
        "button",
        { type: "button", class: "small danger-outline", "aria-label": `Delete ${name}` },
        "Delete",
      );
      del.addEventListener("click", () => this.deleteEntry(entry, del, error));
      actions.append(del);
    }
    return h(
      "tr",
      { dataset: { path: entry.path, kind: entry.kind } },
      nameCell,
      h("td", {
        class: "col-size",
        dataset: { bytes: isDir ? "" : String(entry.byteSize) },
        text: isDir ? "—" : formatSize(entry.byteSize),
      }),
      h("td", { class: "col-modified" }, timeElement(entry.updatedAt, "—")),
      h("td", { class: "col-exec", text: isDir ? "—" : entry.executable ? "Yes" : "No" }),
      h("td", { class: "col-actions" }, actions, error),
    );
  }

  /** Insert or replace entries returned by a write, if they belong on screen. */
  upsertEntries(entries) {
    let changed = false;
    for (const entry of entries) {
      if (entry.deletedAt || parentDir(entry.path) !== this.filesLoadedFor) continue;
      const i = this.entries.findIndex((e) => e.path === entry.path);
      if (i >= 0) this.entries[i] = entry;
      else if (!this.sort) {
        // Server order: place it by name, or leave it to a page not fetched yet.
        const at = this.entries.findIndex((e) => e.path > entry.path);
        if (at >= 0) this.entries.splice(at, 0, entry);
        else if (!this.cursor) this.entries.push(entry);
        else continue;
      } else this.entries.push(entry);
      changed = true;
    }
    if (changed) {
      this.sorted = null;
      this.renderRows();
    }
  }

  async createFolder(button) {
    const name = this.folderNameInput.value.trim().replace(/^\/+|\/+$/g, "");
    this.folderError.textContent = "";
    if (!name) {
      this.folderError.textContent = "Enter a name for the new folder.";
      this.folderNameInput.focus();
      return;
    }
    const path = joinPath(this.dir, name);
    button.disabled = true;
    try {
      const result = await this.api.operation({ action: "mkdir", path });
      this.folderNameInput.value = "";
      if (name.includes("/")) this.reloadFiles();
      else this.upsertEntries(result.files || []);
      this.announce(result.applied ? `Created folder ${name}.` : `Folder ${name} already exists.`);
      this.refreshSync();
    } catch (err) {
      this.folderError.textContent = `Could not create folder ${name}: ${this.explain(err)}`;
    } finally {
      button.disabled = false;
    }
  }

  async deleteEntry(entry, button, error) {
    const name = baseName(entry.path);
    const isDir = entry.kind === "directory";
    const ok = await confirmAction({
      title: `Delete ${name}?`,
      message: isDir
        ? `The folder ${name} and everything in it will move to Trash. You can restore it from Trash until it is purged.`
        : `${name} will move to Trash. You can restore it from Trash until it is purged.`,
      confirmLabel: "Delete",
    });
    if (!ok) return;
    error.textContent = "";
    button.disabled = true;
    try {
      await this.api.operation({ action: "delete", path: entry.path });
      this.entries = this.entries.filter((e) => !isWithin(e.path, entry.path));
      this.rowCache.delete(entry.path);
      this.sorted = null;
      this.renderRows();
      if (this.previewPath && isWithin(this.previewPath, entry.path)) this.closePreview();
      this.announce(`Moved ${name} to Trash.`);
      this.refreshSync();
    } catch (err) {
      error.textContent = `Could not delete ${name}: ${this.explain(err)}`;
      button.disabled = false;
    }
  }

  // --- uploads --------------------------------------------------------------

  enqueueUploads(files) {
    if (this.readOnly || !files.length) return;
    const executable = this.execBox.checked;
    for (const file of files) {
      const item = {
        file,
        path: joinPath(this.dir, file.name),
        executable,
        key: newIdempotencyKey(), // kept for retries of this same upload
        state: "queued",
        abort: null,
      };
      item.el = this.uploadRow(item);
      this.uploads.push(item);
      this.uploadList.append(item.el.li);
    }
    this.announce(`${plural(files.length, "file")} queued for upload.`);
    this.pumpUploads();
  }

  uploadRow(item) {
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
      this.updateUploadRow(item);
      this.pumpUploads();
    });
    cancel.addEventListener("click", () => {
      if (item.state === "uploading" && item.abort) item.abort();
      else if (item.state === "queued") {
        item.state = "failed";
        item.el.error.textContent = "Upload cancelled.";
        this.updateUploadRow(item);
      }
    });
    remove.addEventListener("click", () => {
      this.uploads = this.uploads.filter((u) => u !== item);
      item.el.li.remove();
      this.updateClearButton();
    });
    const dest = parentDir(item.path);
    const li = h(
      "li",
      { class: "upload" },
      h(
        "div",
        { class: "upload-line" },
        h(
          "span",
          { class: "upload-name" },
          name,
          dest ? h("span", { class: "muted", text: ` → ${dest}/` }) : null,
        ),
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
    return { li, progress, state, error, retry, cancel, remove };
  }

  updateUploadRow(item) {
    const el = item.el;
    const label = { queued: "Waiting", uploading: "Uploading", done: "Uploaded", failed: "Failed" }[
      item.state
    ];
    if (item.state !== "uploading" || !el.state.textContent.startsWith("Uploading"))
      el.state.textContent = item.doneText || label;
    el.li.dataset.state = item.state;
    el.retry.hidden = item.state !== "failed";
    el.cancel.hidden = !(item.state === "queued" || item.state === "uploading");
    el.remove.hidden = !(item.state === "failed" || item.state === "done");
    // A full bar next to "Failed" would read as success.
    el.progress.hidden = item.state === "failed";
    if (item.state === "queued") {
      el.error.textContent = "";
      el.progress.value = 0;
    }
    this.updateClearButton();
  }

  updateClearButton() {
    this.clearUploadsButton.hidden = !this.uploads.some((u) => u.state === "done");
  }

  clearFinishedUploads() {
    for (const item of this.uploads.filter((u) => u.state === "done")) item.el.li.remove();
    this.uploads = this.uploads.filter((u) => u.state !== "done");
    this.updateClearButton();
  }

  pumpUploads() {
    while (this.activeUploads < UPLOAD_CONCURRENCY) {
      const next = this.uploads.find((u) => u.state === "queued");
      if (!next) return;
      this.runUpload(next);
    }
  }

  async runUpload(item) {
    item.state = "uploading";
    item.doneText = null;
    this.activeUploads += 1;
    this.updateUploadRow(item);
    const el = item.el;
    try {
      if (item.file.size > UPLOAD_LIMIT) {
        throw new ApiError(413, {
          error: "The file is larger than the server accepts (1 GiB per file).",
          code: "payload_too_large",
        });
      }
      const { promise, abort } = this.api.upload(item.path, item.file, {
        key: item.key,
        executable: item.executable,
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
      el.progress.value = 100;
      if (result && result.file) this.upsertEntries([result.file]);
      this.announce(`${item.doneText}: ${item.file.name}.`);
      this.refreshSync();
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      item.state = "failed";
      el.error.textContent = `Could not upload ${item.file.name}: ${this.explain(err)}`;
    } finally {
      item.abort = null;
      this.activeUploads -= 1;
      if (!this.destroyed) {
        this.updateUploadRow(item);
        this.pumpUploads();
      }
    }
  }

  // --- preview --------------------------------------------------------------

  buildPreviewSection(ids) {
    this.previewHeading = h("h2", { id: ids.preview, tabindex: "-1", text: "Preview" });
    this.previewBody = h("div", { class: "preview-body" });
    this.previewDownload = h("a", { class: "button-link small", text: "Download" });
    const close = h(
      "button",
      { type: "button", class: "small secondary", onClick: () => this.closePreview() },
      "Close preview",
    );
    return h(
      "section",
      { class: "card preview", "aria-labelledby": ids.preview, hidden: true },
      h(
        "div",
        { class: "preview-head" },
        this.previewHeading,
        h("div", { class: "row-actions" }, this.previewDownload, close),
      ),
      this.previewBody,
    );
  }

  revokePreviewUrl() {
    if (this.previewUrl) URL.revokeObjectURL(this.previewUrl);
    this.previewUrl = null;
  }

  closePreview() {
    this.previewSeq += 1;
    this.revokePreviewUrl();
    this.previewPath = null;
    this.previewSection.hidden = true;
    clear(this.previewBody);
    if (this.previewOpener && this.previewOpener.isConnected) this.previewOpener.focus();
    this.previewOpener = null;
  }

  async openPreview(entry, opener) {
    const seq = ++this.previewSeq;
    const name = baseName(entry.path);
    this.revokePreviewUrl();
    this.previewPath = entry.path;
    this.previewOpener = opener;
    this.previewSection.hidden = false;
    this.previewHeading.textContent = `Preview: ${name}`;
    this.previewDownload.href = this.api.contentUrl(entry.path);
    this.previewDownload.download = name;
    this.previewDownload.setAttribute("aria-label", `Download ${name}`);
    const say = (text, cls = "muted") =>
      clear(this.previewBody).append(h("p", { class: cls, text }));
    this.previewHeading.focus();
    if (entry.byteSize > PREVIEW_LIMIT) {
      say(
        `${name} is ${formatSize(entry.byteSize)}, larger than the 8 MiB preview limit. Download it to open it.`,
      );
      return;
    }
    say("Loading preview…");
    let bytes;
    try {
      bytes = await this.api.previewBytes(entry.path);
    } catch (err) {
      if (seq !== this.previewSeq) return;
      if (err instanceof ApiError && err.status === 413) {
        say(`${name} is larger than the 8 MiB preview limit. Download it to open it.`);
      } else {
        clear(this.previewBody).append(
          h("p", {
            class: "error",
            role: "alert",
            text: `Could not load the preview: ${this.explain(err)}`,
          }),
        );
      }
      return;
    }
    if (seq !== this.previewSeq) return;
    const kind = previewKind(entry);
    if (kind === "image") {
      const declared = (entry.contentType || "").split(";")[0].trim();
      const type = declared.startsWith("image/")
        ? declared
        : IMAGE_EXTENSIONS[extension(name)] || "";
      this.previewUrl = URL.createObjectURL(new Blob([bytes], { type }));
      const img = h("img", { src: this.previewUrl, alt: `Preview of ${name}` });
      img.addEventListener("error", () =>
        say(`${name} could not be shown as an image. Download it to open it.`),
      );
      clear(this.previewBody).append(img);
    } else if (kind === "pdf") {
      this.previewUrl = URL.createObjectURL(new Blob([bytes], { type: "application/pdf" }));
      clear(this.previewBody).append(
        h("iframe", { src: this.previewUrl, title: `Preview of ${name}`, class: "pdf" }),
      );
    } else {
      const text = decodeText(bytes);
      if (text === null) {
        say(
          `${name} is not text, an image or a PDF, so it can't be shown here. Download it to open it.`,
        );
      } else if (!text.length) {
        say(`${name} is empty.`);
      } else {
        clear(this.previewBody).append(
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

  // --- trash ----------------------------------------------------------------

  buildTrashSection(ids) {
    this.trashHeading = h("h2", { id: ids.trash, tabindex: "-1", text: "Trash" });
    this.trashBody = h("tbody");
    this.trashSummary = h("p", { class: "muted list-summary" });
    this.trashPrev = h(
      "button",
      { type: "button", class: "secondary", onClick: () => this.turnTrashPage(-1) },
      "Previous page",
    );
    this.trashNext = h(
      "button",
      { type: "button", class: "secondary", onClick: () => this.turnTrashPage(1) },
      "Next page",
    );
    this.trashPager = h("div", { class: "pager", hidden: true }, this.trashPrev, this.trashNext);
    this.trashError = h("p", { class: "error", role: "alert" });
    return h(
      "section",
      { class: "trash-view", "aria-labelledby": ids.trash, hidden: true },
      this.trashHeading,
      h("p", {
        class: "muted",
        text: "Deleted items stay here until they are purged. Restoring brings back the item together with everything deleted with it.",
      }),
      h("div", { class: "table-scroll" }, this.buildTrashTable()),
      h("div", { class: "list-footer" }, this.trashSummary, this.trashPager),
      this.trashError,
    );
  }

  buildTrashTable() {
    const head = h(
      "tr",
      {},
      h("th", { scope: "col", text: "Name" }),
      h("th", { scope: "col", text: "Items" }),
      h("th", { scope: "col", text: "Deleted" }),
      h("th", { scope: "col", class: "col-actions", text: "Actions" }),
    );
    return h(
      "table",
      { class: "listing trash" },
      h("caption", { class: "sr-only", text: "Deleted items" }),
      h("thead", {}, head),
      this.trashBody,
    );
  }

  async reloadTrash() {
    const seq = ++this.trashSeq;
    this.trashError.textContent = "";
    try {
      const page = await this.api.list({ trash: true });
      if (seq !== this.trashSeq || this.destroyed) return;
      this.acceptTrashPage(page, true);
    } catch (err) {
      if (seq !== this.trashSeq) return;
      this.trashError.textContent = `Could not load the trash: ${this.explain(err)}`;
    }
  }

  /**
   * Show another page of batches. Entries arrive newest deletion first, so a
   * batch is complete once a later one has started; fetch until the target
   * page is full and its last batch complete, or the trash is exhausted.
   */
  async turnTrashPage(step) {
    const target = this.trashStart + step * PAGE_SIZE;
    if (target < 0) return;
    const seq = this.trashSeq;
    this.trashPrev.disabled = this.trashNext.disabled = true;
    try {
      while (this.trashCursor && this.trashBatches().length <= target + PAGE_SIZE) {
        const page = await this.api.list({ trash: true, cursor: this.trashCursor });
        if (seq !== this.trashSeq || this.destroyed) return;
        this.acceptTrashPage(page, false, false);
      }
      if (target < this.trashBatches().length) this.trashStart = target;
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      this.trashError.textContent = `Could not load more of the trash: ${this.explain(err)}`;
    } finally {
      if (seq === this.trashSeq) this.renderTrash();
    }
  }

  acceptTrashPage(page, reset, render = true) {
    if (reset) {
      this.trashEntries = [];
      this.trashStart = 0;
    }
    this.trashEntries.push(...page.entries);
    this.trashCursor = page.nextCursor;
    if (render) this.renderTrash();
  }

  /** Entries deleted together (same trash root and time) form one batch. */
  trashBatches() {
    const batches = new Map();
    for (const entry of this.trashEntries) {
      const rootId = entry.trashRoot || entry.id;
      const key = `${rootId}|${entry.deletedAt}`;
      if (!batches.has(key)) batches.set(key, { rootId, deletedAt: entry.deletedAt, entries: [] });
      batches.get(key).entries.push(entry);
    }
    return [...batches.values()].map((batch) => {
      const root =
        batch.entries.find((e) => e.id === batch.rootId) ||
        batch.entries.reduce((a, b) => (a.path.length <= b.path.length ? a : b));
      return { ...batch, root };
    });
  }

  renderTrash() {
    const batches = this.trashBatches();
    const total = batches.length;
    if (this.trashStart >= total) {
      this.trashStart = Math.max(0, Math.floor((total - 1) / PAGE_SIZE) * PAGE_SIZE);
    }
    const shown = batches.slice(this.trashStart, this.trashStart + PAGE_SIZE);
    const fragment = document.createDocumentFragment();
    for (const batch of shown) {
      // The newest-loaded batch may continue on a page not fetched yet.
      const partial = Boolean(this.trashCursor) && batch === batches[total - 1];
      fragment.append(this.trashRowFor(batch, partial));
    }
    if (!total) {
      fragment.append(
        h("tr", { class: "empty" }, h("td", { colspan: "4", text: "Trash is empty." })),
      );
    }
    this.trashBody.replaceChildren(fragment);
    const paged = total > PAGE_SIZE || Boolean(this.trashCursor);
    this.trashPager.hidden = !paged;
    this.trashPrev.disabled = this.trashStart === 0;
    this.trashNext.disabled = this.trashStart + PAGE_SIZE >= total && !this.trashCursor;
    const range = `${(this.trashStart + 1).toLocaleString()}–${(this.trashStart + shown.length).toLocaleString()}`;
    const count = total === 1 ? "1 deleted item" : `${total.toLocaleString()} deleted items`;
    if (!paged) this.trashSummary.textContent = "";
    else if (this.trashCursor) {
      this.trashSummary.textContent = `Showing ${range} of the first ${count}; the trash has more.`;
    } else this.trashSummary.textContent = `Showing ${range} of ${count}.`;
  }

  trashRowFor(batch, partial = false) {
    const { root } = batch;
    const name = root.path;
    const isDir = root.kind === "directory";
    const inside = batch.entries.length - 1;
    const error = h("p", { class: "error row-error", role: "alert" });
    const actions = h("div", { class: "row-actions" });
    if (!this.readOnly) {
      const restore = h(
        "button",
        { type: "button", class: "small", "aria-label": `Restore ${name}` },
        "Restore",
      );
      const purge = h(
        "button",
        { type: "button", class: "small danger-outline", "aria-label": `Purge ${name}` },
        "Purge",
      );
      restore.addEventListener("click", () => this.restoreBatch(batch, restore, error));
      purge.addEventListener("click", () => this.purgeBatch(batch, purge, error));
      actions.append(restore, purge);
    }
    return h(
      "tr",
      { dataset: { path: root.path, kind: root.kind } },
      h(
        "th",
        { scope: "row", class: "col-name" },
        h(
          "span",
          { class: `entry-name ${isDir ? "dir" : "file"}` },
          h("span", { class: `icon ${isDir ? "icon-dir" : "icon-file"}`, "aria-hidden": "true" }),
          isDir ? `${name}/` : name,
        ),
      ),
      h("td", {
        text: isDir
          ? `Folder with ${partial ? "at least " : ""}${plural(inside, "item")}`
          : formatSize(root.byteSize),
      }),
      h("td", {}, timeElement(batch.deletedAt, "—")),
      h("td", { class: "col-actions" }, actions, error),
    );
  }

  dropBatch(batch) {
    const ids = new Set(batch.entries.map((e) => e.id));
    this.trashEntries = this.trashEntries.filter((e) => !ids.has(e.id));
    this.renderTrash();
  }

  async restoreBatch(batch, button, error) {
    const name = batch.root.path;
    error.textContent = "";
    button.disabled = true;
    try {
      await this.api.operation({ action: "restore", fileId: batch.rootId });
      this.dropBatch(batch);
      this.filesLoadedFor = null; // the files view reloads when shown again
      this.announce(`Restored ${name}.`);
      this.refreshSync();
    } catch (err) {
      button.disabled = false;
      if (err instanceof ApiError && err.code === "restore_collision") {
        // The message names the occupied paths; say what to do about it.
        error.textContent = `${err.message}. Move or delete what is there now, then restore again.`;
      } else {
        error.textContent = `Could not restore ${name}: ${this.explain(err)}`;
      }
    }
  }

  async purgeBatch(batch, button, error) {
    const name = batch.root.path;
    const inside = batch.entries.length - 1;
    const contents = inside
      ? ` and ${batch.partial ? "at least " : ""}${plural(inside, "item")} inside it`
      : "";
    const ok = await confirmAction({
      title: `Purge ${name}?`,
      message: `${name}${contents} will be deleted permanently. This cannot be undone.`,
      confirmLabel: "Purge permanently",
    });
    if (!ok) return;
    error.textContent = "";
    button.disabled = true;
    try {
      await this.api.operation({ action: "purge", fileId: batch.rootId });
      this.dropBatch(batch);
      this.announce(`Permanently deleted ${name}.`);
      this.refreshSync();
    } catch (err) {
      button.disabled = false;
      error.textContent = `Could not purge ${name}: ${this.explain(err)}`;
    }
  }

  // --- sync panel -----------------------------------------------------------

  buildSyncSection(ids) {
    this.filesUpdated = h("span", { class: "files-updated-value" });
    this.runList = h("ul", { class: "runs" });
    this.syncError = h("p", { class: "error", role: "alert" });
    return h(
      "section",
      { class: "card sync", "aria-labelledby": ids.sync },
      h("h2", { id: ids.sync, text: "Sync" }),
      h("p", { class: "files-updated" }, "Files updated: ", this.filesUpdated),
      h("p", {
        class: "help",
        text: "Files updated is the last direct change here (upload, new folder, delete, restore or purge). Agent saves are listed per run below.",
      }),
      h("h3", { text: "Agent runs" }),
      this.runList,
      this.syncError,
    );
  }

  renderFilesUpdated(iso) {
    if (this.filesUpdated) this.filesUpdated.replaceChildren(timeElement(iso, "no changes yet"));
  }

  async refreshSync() {
    if (this.destroyed || !this.runList) return;
    try {
      const data = await this.api.sync();
      if (this.destroyed) return;
      this.syncError.textContent = "";
      this.lastSync = data;
      this.renderSync(data);
    } catch (err) {
      if (this.destroyed) return;
      if (!(err instanceof ApiError)) throw err;
      this.syncError.textContent = `Could not load the sync state: ${this.explain(err)}`;
    }
  }

  renderSync(data) {
    this.renderFilesUpdated(data.lastOperationAt);
    // A run whose state did not change keeps its element, so a poll never
    // takes keyboard focus or a pending message away from it.
    const previous = this.runItems || new Map();
    this.runItems = new Map();
    const items = data.runs.map((run) => {
      const key = JSON.stringify(run) + (this.agentNames.get(run.agentId) || "");
      const old = previous.get(run.runId);
      const note = old ? old.li.querySelector(".refresh-note").textContent : "";
      const li = old && old.key === key ? old.li : this.runItem(run, note);
      this.runItems.set(run.runId, { key, li });
      return li;
    });
    if (!items.length) {
      items.push(h("li", { class: "muted", text: "No agent runs have used this folder." }));
    }
    const unchanged =
      items.length === this.runList.children.length &&
      items.every((li, i) => this.runList.children[i] === li);
    if (unchanged) return;
    const focusedRun = document.activeElement?.closest?.(".runs li[data-run-id]");
    this.runList.replaceChildren(...items);
    if (focusedRun && !focusedRun.isConnected) {
      this.runItems.get(focusedRun.dataset.runId)?.li.querySelector("button")?.focus();
    }
  }

  runItem(run, note) {
    const agent = this.agentNames.get(run.agentId) || `Agent ${run.agentId.slice(0, 8)}`;
    const stateLabel = RUN_STATE_LABEL[run.state] || run.state;
    const refreshNote = h("p", { class: "refresh-note", role: "status", text: note });
    const refreshError = h("p", { class: "error", role: "alert" });
    let refresh = null;
    if (run.active && !this.readOnly) {
      // aria-disabled rather than disabled: a disabled button drops keyboard
      // focus to the top of the page right after it was pressed.
      refresh = h("button", { type: "button", class: "small refresh" });
      const showRequested = (requested) => {
        const label = requested ? "Refresh requested" : "Request refresh";
        refresh.textContent = label;
        refresh.setAttribute("aria-label", `${label} for ${agent}`);
        refresh.setAttribute("aria-disabled", String(requested));
      };
      showRequested(run.refreshRequested);
      refresh.addEventListener("click", async () => {
        if (refresh.getAttribute("aria-disabled") === "true") return;
        refresh.setAttribute("aria-disabled", "true");
        refreshError.textContent = "";
        try {
          await this.api.requestRefresh(run.runId);
          showRequested(true);
          refreshNote.textContent =
            "Refresh requested: the agent picks up changes at its next safe point.";
        } catch (err) {
          showRequested(false);
          refreshError.textContent = `Could not request a refresh: ${this.explain(err)}`;
        }
      });
    }
    return h(
      "li",
      { class: "run", dataset: { runId: run.runId, state: run.state } },
      h(
        "p",
        { class: "run-head" },
        h("strong", { text: agent }),
        h("span", { class: `state state-${run.state}`, text: stateLabel }),
        h("span", { class: "muted", text: run.active ? "running" : "ended" }),
      ),
      h("p", {}, "Last agent save: ", timeElement(run.lastSavedAt, "not yet")),
      run.finalCheckpointAt ? h("p", {}, "Final save: ", timeElement(run.finalCheckpointAt)) : null,
      run.error ? h("p", { class: "error run-error", text: `Error: ${run.error}` }) : null,
      h(
        "p",
        { class: "muted small-text" },
        "Started ",
        timeElement(run.startedAt, "—"),
        run.endedAt ? [", ended ", timeElement(run.endedAt)] : null,
      ),
      refresh,
      refreshNote,
      refreshError,
    );
  }
}
