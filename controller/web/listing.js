// The files view: breadcrumbs, the toolbar (uploads, new folder), the drop
// zone and the listing of one directory's direct children, with Delete.
//
// At most PAGE_SIZE rows are in the document at any time, whatever the
// folder holds: laying out a table of ten thousand rows takes seconds, two
// hundred rows take milliseconds. Entries arrive from the API a page at a
// time, in the server's order (by name, byte order), and later pages are
// fetched only when the user pages forward. Sorting by a column needs every
// entry, so the first click on a header of a partly loaded folder loads the
// rest first.

import { ApiError, PAGE_SIZE } from "./api.js";
import { confirmAction } from "./dialog.js";
import { baseName, clear, formatSize, h, isWithin, parentDir, timeElement } from "./dom.js";
import { NewFolderForm } from "./newfolder.js";
import { Pager, clampStart, countText, entryName, showingText } from "./table.js";

const SORT_LABEL = { name: "Name", size: "Size", modified: "Modified", executable: "Executable" };
const NAME_ORDER = new Intl.Collator(undefined, { numeric: true, sensitivity: "base" });

const SORT_VALUE = {
  name: () => 0,
  size: (e) => e.byteSize || 0,
  modified: (e) => Date.parse(e.updatedAt) || 0,
  executable: (e) => (e.executable ? 1 : 0),
};

/** `entries` sorted by `sort`; directories first either way, ties by name. */
function sortEntries(entries, { key, ascending }) {
  const value = SORT_VALUE[key];
  // Keys are computed once per entry, not once per comparison.
  const items = entries.map((entry) => ({
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

export class Listing {
  constructor(folder, ids) {
    this.folder = folder;
    this.entries = [];
    this.rowCache = new Map(); // path -> {entry, tr}: rows are rebuilt only when their entry changes
    this.cursor = null;
    this.loadedFor = null; // dir whose listing is in this.entries
    this.seq = 0; // discards answers to superseded listing requests
    this.sort = null; // null: the server's order, until a header is clicked
    this.sorted = null; // this.entries in display order; null when stale
    this.start = 0; // index in the display order of the first row shown
    this.section = this.build(ids);
  }

  build(ids) {
    const { folder } = this;
    this.heading = h("h2", { id: ids.files, class: "sr-only", tabindex: "-1", text: "Files" });
    this.crumbs = h("nav", { class: "crumbs", "aria-label": "Folder path" });

    this.newFolder = new NewFolderForm(folder, ids);
    const toolbar = folder.readOnly
      ? h("p", { class: "muted", text: "You have view-only access to this folder." })
      : h("div", { class: "toolbar" }, folder.uploads.controls, this.newFolder.form);

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
    const table = h(
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
    const dropZone = h(
      "div",
      { class: "dropzone" },
      this.dropHint,
      h("div", { class: "table-scroll" }, table),
    );
    if (!folder.readOnly) folder.uploads.acceptDrops(dropZone);

    this.summary = h("p", { class: "muted list-summary", "aria-live": "polite" });
    this.pager = new Pager((step) => this.turnPage(step));
    this.error = h("p", { class: "error", role: "alert" });

    return h(
      "section",
      { class: "files-view", "aria-labelledby": ids.files },
      this.heading,
      this.crumbs,
      toolbar,
      this.newFolder.error,
      folder.uploads.box,
      dropZone,
      h("div", { class: "list-footer" }, this.summary, this.pager.el),
      this.error,
    );
  }

  /** Where focus goes when the user moves to another directory. */
  currentCrumb() {
    return this.crumbs.querySelector("[aria-current]");
  }

  renderBreadcrumbs() {
    const { dir } = this.folder;
    const rootLabel = this.folder.rootLabel();
    const items = [{ label: rootLabel, dir: "" }];
    if (dir) {
      const parts = dir.split("/");
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
            : h("a", { href: this.folder.dirUrl(item.dir), "data-nav": true, text: item.label }),
        ),
      );
    });
    clear(this.crumbs).append(list);
    this.caption.textContent = dir ? `Contents of ${dir}` : `Contents of ${rootLabel}`;
    this.dropHint.textContent = `Drop files here to upload them to ${dir || "the top of this folder"}.`;
  }

  /** Show the folder's current directory, loading it unless it is on screen. */
  showDir() {
    this.renderBreadcrumbs();
    if (this.loadedFor !== this.folder.dir) this.reload();
  }

  /** Forget the loaded directory: it reloads when the files view is shown again. */
  invalidate() {
    this.loadedFor = null;
  }

  async reload() {
    const { dir } = this.folder;
    const seq = ++this.seq;
    this.error.textContent = "";
    this.tbody.setAttribute("aria-busy", "true");
    try {
      const page = await this.folder.api.list({ dir });
      if (seq !== this.seq || this.folder.destroyed) return;
      this.acceptPage(page, dir, true);
      this.folder.sync.showFilesUpdated(page.lastOperationAt);
    } catch (err) {
      if (seq !== this.seq || this.folder.destroyed) return;
      this.error.textContent = `Could not load this directory: ${this.folder.explain(err)}`;
    } finally {
      if (seq === this.seq) this.tbody.removeAttribute("aria-busy");
    }
  }

  /** Fetch the next API page of this directory; false when it failed. */
  async fetchMore({ render = true } = {}) {
    const { dir } = this.folder;
    const seq = this.seq;
    this.error.textContent = "";
    try {
      const page = await this.folder.api.list({ dir, cursor: this.cursor });
      if (seq !== this.seq || this.folder.destroyed) return false;
      this.acceptPage(page, dir, false, render);
      return true;
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      this.error.textContent = `Could not load more entries: ${this.folder.explain(err)}`;
      return false;
    }
  }

  async turnPage(step) {
    const target = this.start + step * PAGE_SIZE;
    if (target < 0) return;
    this.pager.disable();
    try {
      if (target >= this.entries.length && this.cursor && !(await this.fetchMore())) return;
      if (target >= this.displayOrder().length) return;
      this.start = target;
    } finally {
      this.renderRows();
    }
  }

  /** Everything left in this directory; used before sorting by a column. */
  async fetchAll() {
    this.summary.textContent = "Loading all entries to sort them…";
    while (this.cursor) {
      // One render at the end: each intermediate one would cost a layout.
      if (!(await this.fetchMore({ render: false }))) {
        this.renderRows();
        return false;
      }
    }
    return true;
  }

  acceptPage(page, dir, reset, render = true) {
    if (reset) {
      this.entries = [];
      this.rowCache.clear();
      this.start = 0;
      this.sort = page.nextCursor ? null : { key: "name", ascending: true };
    }
    // An upload may already have placed an entry that a later page repeats.
    const known = new Set(this.entries.map((e) => e.path));
    for (const entry of page.entries) if (!known.has(entry.path)) this.entries.push(entry);
    this.cursor = page.nextCursor;
    this.loadedFor = dir;
    this.sorted = null;
    if (render) this.renderRows();
  }

  async toggleSort(key) {
    if (this.cursor && !(await this.fetchAll())) return;
    const current = this.sort || { key: "name", ascending: true };
    this.sort =
      current.key === key ? { key, ascending: !current.ascending } : { key, ascending: true };
    this.sorted = null;
    this.start = 0;
    this.renderRows();
    const sortName = SORT_LABEL[key].toLowerCase();
    this.folder.announce(
      `Sorted by ${sortName}, ${this.sort.ascending ? "ascending" : "descending"}.`,
    );
  }

  /** Loaded entries in display order (cached until entries or sort change). */
  displayOrder() {
    if (!this.sorted) {
      this.sorted = this.sort ? sortEntries(this.entries, this.sort) : [...this.entries];
    }
    return this.sorted;
  }

  renderSortHeaders() {
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
  }

  renderRows() {
    this.renderSortHeaders();
    const order = this.displayOrder();
    const total = order.length;
    this.start = clampStart(this.start, total);
    const shown = order.slice(this.start, this.start + PAGE_SIZE);
    const fragment = document.createDocumentFragment();
    for (const entry of shown) fragment.append(this.rowFor(entry));
    if (!total) {
      fragment.append(
        h(
          "tr",
          { class: "empty" },
          h("td", {
            colspan: "5",
            text: this.folder.readOnly
              ? "This directory is empty."
              : "This directory is empty. Drop files here or use Upload files.",
          }),
        ),
      );
    }
    this.tbody.replaceChildren(fragment);

    const more = Boolean(this.cursor);
    const paged = this.pager.update(this.start, total, more);
    const count = countText(total, "entry", "entries");
    if (!total) this.summary.textContent = "";
    else if (!paged) this.summary.textContent = `${count}.`;
    else {
      this.summary.textContent = showingText(
        this.start,
        shown.length,
        count,
        more,
        "this directory",
      );
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
    const { folder } = this;
    const name = baseName(entry.path);
    const isDir = entry.kind === "directory";
    const error = h("p", { class: "error row-error", role: "alert" });
    const nameCell = h(
      "th",
      { scope: "row", class: "col-name" },
      entryName(entry.kind, name, isDir ? folder.dirUrl(entry.path) : null),
    );
    const actions = h("div", { class: "row-actions" });
    if (!isDir) {
      const preview = h(
        "button",
        { type: "button", class: "small", "aria-label": `Preview ${name}` },
        "Preview",
      );
      preview.addEventListener("click", () => folder.preview.open(entry, preview));
      actions.append(
        preview,
        h("a", {
          class: "button-link small",
          href: folder.api.contentUrl(entry.path),
          download: name,
          "aria-label": `Download ${name}`,
          text: "Download",
        }),
      );
    }
    if (!folder.readOnly) {
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
      if (entry.deletedAt || parentDir(entry.path) !== this.loadedFor) continue;
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

  async deleteEntry(entry, button, error) {
    const { folder } = this;
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
    await folder.rowOperation(
      { action: "delete", path: entry.path },
      {
        button,
        error,
        applied: () => {
          this.entries = this.entries.filter((e) => !isWithin(e.path, entry.path));
          this.rowCache.delete(entry.path);
          this.sorted = null;
          this.renderRows();
          folder.preview.closeIfWithin(entry.path);
        },
        success: `Moved ${name} to Trash.`,
        failure: (err) => `Could not delete ${name}: ${folder.explain(err)}`,
      },
    );
  }
}
