// The files view: breadcrumbs, the toolbar (uploads, new folder, name
// filter), the selection bar and the listing of one directory's direct
// children. Rows are built in rows.js, keyboard work is keys.js, rename and
// move are moveops.js, and delta.js merges writes and changes into the
// loaded entries.
//
// At most PAGE_SIZE rows are in the document at any time, whatever the
// folder holds: laying out a table of ten thousand rows takes seconds, two
// hundred rows take milliseconds. Entries arrive from the API a page at a
// time, in the server's order (by name, byte order), and later pages are
// fetched only when the user pages forward. Sorting by a column needs every
// entry, so the first click on a header of a partly loaded folder loads the
// rest first (the sort itself is sorting.js). The name filter runs on the
// server, so it covers every entry.

import { ApiError, PAGE_SIZE } from "./api.js";
import { confirmAction } from "./dialog.js";
import { baseName, clear, h, isWithin, plural } from "./dom.js";
import { RowKeys } from "./keys.js";
import { MoveOps } from "./moveops.js";
import { NewFolderForm } from "./newfolder.js";
import { applyChanges, upsertInto } from "./delta.js";
import { buildRow, rowLink } from "./rows.js";
import { SORT_LABEL, sortEntries } from "./sorting.js";
import { Pager, clampStart, countText } from "./table.js";

const FILTER_DELAY_MS = 250;

export class Listing {
  constructor(folder, ids) {
    this.folder = folder;
    this.entries = [];
    this.rowCache = new Map(); // path -> {entry, tr}: rows are rebuilt only when their entry changes
    this.cursor = null;
    this.loadedUpTo = null; // the last path of the last page fetched
    this.total = 0; // entries the server has for this directory and filter
    this.version = 0; // the folder version the loaded entries show
    this.loadedFor = null; // dir whose listing is in this.entries
    this.seq = 0; // discards answers to superseded listing requests
    this.sort = null; // null: the server's order, until a header is clicked
    this.sorted = null; // this.entries in display order; null when stale
    this.start = 0; // index in the display order of the first row shown
    this.selected = new Set(); // paths
    this.name = folder.route.q || ""; // the name filter
    this.wantedPage = folder.route.page || 1; // from the URL, until it is reached
    this.ops = new MoveOps(this);
    this.section = this.build(ids);
    this.keys = new RowKeys(this);
  }

  build(ids) {
    const { folder } = this;
    this.heading = h("h2", { id: ids.files, class: "sr-only", tabindex: "-1", text: "Files" });
    this.crumbs = h("nav", { class: "crumbs", "aria-label": "Folder path" });

    this.newFolder = new NewFolderForm(folder, ids);
    const toolbar = folder.readOnly
      ? h("p", { class: "muted", text: "You have view-only access to this folder." })
      : h("div", { class: "toolbar" }, folder.uploads.controls, this.newFolder.form);

    this.filter = h("input", {
      id: ids.filter,
      type: "search",
      autocomplete: "off",
      spellcheck: "false",
      value: this.name,
    });
    let timer = null;
    this.filter.addEventListener("input", () => {
      clearTimeout(timer);
      timer = setTimeout(() => this.setFilter(this.filter.value.trim()), FILTER_DELAY_MS);
    });
    const filterForm = h(
      "form",
      { class: "filter", role: "search" },
      h("label", { for: ids.filter, text: "Filter by name" }),
      this.filter,
    );
    filterForm.addEventListener("submit", (e) => {
      e.preventDefault();
      clearTimeout(timer);
      this.setFilter(this.filter.value.trim());
    });

    this.bulkCount = h("span", { class: "bulk-count" });
    const bulkButton = (label, action, cls = "small") =>
      h("button", { type: "button", class: cls, onClick: () => action(this.selectedEntries()) }, label);
    this.bulkBar = h(
      "div",
      { class: "bulk", role: "region", "aria-label": "Selected items", hidden: true },
      this.bulkCount,
      bulkButton("Download", (e) => this.ops.downloadSelected(e)),
      folder.readOnly ? null : bulkButton("Move…", (e) => this.ops.move(e)),
      folder.readOnly ? null : bulkButton("Delete…", (e) => this.ops.deleteSelected(e), "small danger-outline"),
      bulkButton("Clear selection", () => this.clearSelection(), "small secondary"),
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
    this.selectAll = h("input", { type: "checkbox", "aria-label": "Select all shown" });
    this.selectAll.addEventListener("change", () => this.selectShown(this.selectAll.checked));
    this.caption = h("caption", { class: "sr-only" });
    const table = h(
      "table",
      { class: "listing files" },
      this.caption,
      h(
        "thead",
        {},
        h(
          "tr",
          {},
          h("td", { class: "col-select" }, h("label", { class: "check-target" }, this.selectAll)),
          header("name", "col-name"),
          header("size", "col-size"),
          header("modified", "col-modified"),
          header("executable", "col-exec"),
          h("th", { scope: "col", class: "col-actions", text: "Actions" }),
        ),
      ),
      this.tbody,
    );

    this.dropHint = folder.readOnly ? null : h("p", { class: "drop-hint muted" });
    const dropZone = h("div", { class: "dropzone" }, this.dropHint, table);
    if (!folder.readOnly) folder.uploads.acceptDrops(dropZone);

    this.summary = h("p", { class: "muted list-summary", "aria-live": "polite" });
    this.pager = new Pager((step) => this.turnPage(step));
    this.error = h("p", { class: "error list-error", role: "alert" });

    return h(
      "section",
      { class: "files-view", "aria-labelledby": ids.files },
      this.heading,
      this.crumbs,
      toolbar,
      this.newFolder.error,
      filterForm,
      this.bulkBar,
      this.error,
      dropZone,
      h("div", { class: "list-footer" }, this.summary, this.pager.el),
    );
  }

  renderBreadcrumbs() {
    const { dir } = this.folder;
    const rootLabel = this.folder.rootLabel();
    const parts = dir ? dir.split("/") : [];
    const items = [{ label: rootLabel, dir: "" }];
    parts.forEach((part, i) => items.push({ label: part, dir: parts.slice(0, i + 1).join("/") }));
    const list = h("ol");
    items.forEach((item, i) => {
      const last = i === items.length - 1;
      list.append(
        h(
          "li",
          {},
          last
            ? h("span", { "aria-current": "location", text: item.label })
            : h("a", { href: this.folder.dirUrl(item.dir), "data-nav": true, text: item.label }),
        ),
      );
    });
    clear(this.crumbs).append(list);
    this.caption.textContent = dir ? `Contents of ${dir}` : `Contents of ${rootLabel}`;
    if (this.dropHint) {
      this.dropHint.textContent = `Drop files here to upload them to ${dir || "the top of this folder"}.`;
    }
  }

  /** Show the folder's current directory, loading it unless it is on screen. */
  showDir() {
    this.renderBreadcrumbs();
    if (this.loadedFor !== this.folder.dir) {
      // Another directory starts with the address's filter and page (usually none).
      const { q, page } = this.folder.route;
      this.name = q || "";
      this.filter.value = this.name;
      this.wantedPage = page || 1;
      this.selected.clear();
      this.reload();
    }
  }

  /** Forget the loaded directory: it reloads when the files view is shown again. */
  invalidate() {
    this.loadedFor = null;
  }

  setFilter(name) {
    if (name === this.name) return;
    this.name = name;
    this.wantedPage = 1;
    this.folder.replaceParams({ q: name || null, page: null });
    this.selected.clear();
    this.reload();
  }

  async reload() {
    const { dir } = this.folder;
    const seq = ++this.seq;
    this.error.textContent = "";
    this.tbody.setAttribute("aria-busy", "true");
    try {
      const page = await this.folder.api.list({ dir, name: this.name });
      if (seq !== this.seq || this.folder.destroyed) return;
      this.acceptPage(page, dir, true);
      this.folder.sync.showFilesUpdated(page.lastOperationAt);
      await this.openWantedPage();
    } catch (err) {
      if (seq !== this.seq || this.folder.destroyed) return;
      this.error.textContent = `Could not load this directory: ${this.folder.explain(err)}`;
    } finally {
      if (seq === this.seq) this.tbody.removeAttribute("aria-busy");
    }
  }

  /** A `?page=N` from the URL: fetch pages until it is loaded, then show it. */
  async openWantedPage() {
    const wanted = this.wantedPage;
    this.wantedPage = 1;
    if (wanted <= 1) return;
    const target = (wanted - 1) * PAGE_SIZE;
    while (this.entries.length < target + PAGE_SIZE && this.cursor) {
      if (!(await this.fetchMore({ render: false }))) break;
    }
    this.start = clampStart(target, this.entries.length);
    this.renderRows();
  }

  /**
   * Bring the loaded pages up to date (the folder changed, or this page
   * moved or deleted something), keeping the current page, sort and focus:
   * only what changed in the directory is fetched, and rows whose entry did
   * not change keep their elements.
   */
  async reloadKeepingPlace() {
    if (this.loadedFor !== this.folder.dir) return this.reload();
    try {
      await this.refreshChanged();
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      this.error.textContent = `Could not refresh: ${this.folder.explain(err)}`;
    }
  }

  /**
   * What changed in the directory since the version on screen (one
   * GET /changes with its entries), merged in; when more changed than one
   * answer holds, the loaded pages are listed again. The folder version the
   * server answered with, or null when this answer was superseded.
   */
  async refreshChanged() {
    const { dir } = this.folder;
    if (this.loadedFor !== dir) return null;
    // A poll does not supersede a page being fetched; a new listing supersedes it.
    const seq = this.seq;
    const delta = await this.folder.api.changes(this.version, dir, { entries: true, name: this.name });
    if (seq !== this.seq || this.folder.destroyed) return null;
    if (delta.changed && !delta.complete) {
      await this.refetchPages();
      return delta.version;
    }
    if (delta.changed) {
      applyChanges(this, delta);
      this.folder.sync.showFilesUpdated(delta.lastOperationAt);
      this.renderRows();
    }
    this.version = Math.max(this.version, delta.version);
    return delta.version;
  }

  /** List the loaded pages of the directory again. */
  async refetchPages() {
    const { dir } = this.folder;
    const seq = ++this.seq;
    const pages = Math.max(1, Math.ceil(this.entries.length / PAGE_SIZE));
    const fresh = [];
    let cursor = null;
    let last = null;
    try {
      for (let i = 0; i < pages; i += 1) {
        last = await this.folder.api.list({ dir, name: this.name, cursor });
        if (seq !== this.seq || this.folder.destroyed) return;
        fresh.push(...last.entries);
        cursor = last.nextCursor;
        if (!cursor) break;
      }
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      if (seq === this.seq) this.error.textContent = `Could not refresh: ${this.folder.explain(err)}`;
      return;
    }
    this.entries = fresh;
    this.cursor = cursor;
    if (fresh.length) this.loadedUpTo = fresh[fresh.length - 1].path;
    this.total = last.total;
    this.version = Math.max(this.version, last.version);
    this.loadedFor = dir;
    this.sorted = null;
    const known = new Set(fresh.map((e) => e.path));
    for (const path of [...this.selected]) if (!known.has(path)) this.selected.delete(path);
    this.folder.sync.showFilesUpdated(last.lastOperationAt);
    this.renderRows();
  }

  /** Fetch the next API page of this directory; false when it failed. */
  async fetchMore({ render = true } = {}) {
    const { dir } = this.folder;
    const seq = this.seq;
    this.error.textContent = "";
    try {
      const page = await this.folder.api.list({ dir, name: this.name, cursor: this.cursor });
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
      // Entries merged in may fill part of the next page: fetch until it is full.
      if (this.cursor && target + PAGE_SIZE > this.entries.length) {
        if (!(await this.fetchMore()) && target >= this.entries.length) return;
      }
      if (target >= this.displayOrder().length) return;
      this.start = target;
    } finally {
      this.renderRows();
      const page = Math.floor(this.start / PAGE_SIZE) + 1;
      this.folder.replaceParams({ page: page > 1 ? String(page) : null });
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
    if (reset) this.loadedUpTo = null;
    if (page.entries.length) this.loadedUpTo = page.entries[page.entries.length - 1].path;
    this.total = page.total;
    this.version = Math.max(this.version, page.version || 0);
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

  entryAt(path) {
    return this.entries.find((e) => e.path === path) || null;
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
    const loaded = order.length;
    this.start = clampStart(this.start, loaded);
    const shown = order.slice(this.start, this.start + PAGE_SIZE);
    // Re-inserting a row takes focus off it; give it back afterwards (to the
    // same path's new row when its entry changed and the row was rebuilt).
    const focused = this.tbody.contains(document.activeElement) ? document.activeElement : null;
    const focusedPath = focused?.closest("tr[data-path]")?.dataset.path;
    const fragment = document.createDocumentFragment();
    for (const entry of shown) fragment.append(this.rowFor(entry));
    if (!loaded) {
      let text = "This directory is empty.";
      if (this.name) text = `Nothing here has a name containing “${this.name}”.`;
      else if (!this.folder.readOnly) text += " Drop files here or use Upload files.";
      fragment.append(h("tr", { class: "empty" }, h("td", { colspan: "6", text })));
    }
    this.tbody.replaceChildren(fragment);
    this.keys.restore();
    if (focused && focused.isConnected) focused.focus({ preventScroll: true });
    else if (focusedPath) {
      const tr = [...this.tbody.querySelectorAll("tr[data-path]")].find(
        (r) => r.dataset.path === focusedPath,
      );
      if (tr) {
        this.keys.activate(tr);
        rowLink(tr).focus({ preventScroll: true });
      }
    }
    this.renderSelection();

    const more = Boolean(this.cursor);
    const total = Math.max(this.total, loaded);
    const paged = this.pager.update(this.start, loaded, more);
    const count = countText(total, "entry", "entries");
    const matching = this.name ? ` with “${this.name}” in the name` : "";
    if (!loaded) this.summary.textContent = "";
    else if (!paged) this.summary.textContent = `${count}${matching}.`;
    else {
      const range = `${(this.start + 1).toLocaleString()}–${(this.start + shown.length).toLocaleString()}`;
      this.summary.textContent = `Showing ${range} of ${count}${matching}.`;
    }
  }

  rowFor(entry) {
    const cached = this.rowCache.get(entry.path);
    if (cached && cached.entry.id === entry.id && cached.entry.version === entry.version) {
      cached.entry = entry;
      cached.tr.querySelector(".row-select").checked = this.selected.has(entry.path);
      return cached.tr;
    }
    const { tr } = buildRow(this, entry);
    this.rowCache.set(entry.path, { entry, tr });
    return tr;
  }

  // --- selection ------------------------------------------------------------

  selectedEntries() {
    return this.entries.filter((e) => this.selected.has(e.path));
  }

  toggleSelected(path, on) {
    if (on) this.selected.add(path);
    else this.selected.delete(path);
    this.renderSelection();
  }

  selectShown(on) {
    for (const tr of this.tbody.querySelectorAll("tr[data-path]")) {
      tr.querySelector(".row-select").checked = on;
      if (on) this.selected.add(tr.dataset.path);
      else this.selected.delete(tr.dataset.path);
    }
    this.renderSelection();
  }

  clearSelection() {
    this.selectShown(false);
    this.selected.clear();
    this.renderSelection();
  }

  renderSelection() {
    const n = this.selected.size;
    this.bulkBar.hidden = n === 0;
    this.bulkCount.textContent = `${plural(n, "item")} selected`;
    const boxes = [...this.tbody.querySelectorAll(".row-select")];
    this.selectAll.checked = boxes.length > 0 && boxes.every((b) => b.checked);
    this.selectAll.indeterminate = !this.selectAll.checked && boxes.some((b) => b.checked);
  }

  // --- focus ----------------------------------------------------------------

  /** Focus the row of `path`, or the first row, or the page heading. */
  focusPath(path) {
    const tr = [...this.tbody.querySelectorAll("tr[data-path]")].find(
      (r) => r.dataset.path === path,
    );
    if (tr) {
      this.keys.activate(tr);
      rowLink(tr).focus();
    } else this.focusAfterChange();
  }

  /** After rows went away: the row now at the active row's place, or the heading. */
  focusAfterChange(index = null) {
    const rows = [...this.tbody.querySelectorAll("tr[data-path]")];
    const at = index ?? Math.max(0, rows.findIndex((r) => r.dataset.path === this.keys.active));
    if (!this.keys.focusIndex(at)) this.folder.titleEl.focus();
  }

  /** `path` (and everything below it) became `entries`, the answer of a move. */
  replaceEntry(path, entries) {
    const before = this.entries.length;
    this.entries = this.entries.filter((e) => !isWithin(e.path, path));
    this.total = Math.max(0, this.total - (before - this.entries.length));
    this.rowCache.delete(path);
    if (this.selected.delete(path)) this.renderSelection();
    this.sorted = null;
    this.upsertEntries(entries);
    this.renderRows();
  }

  /** Insert or replace entries returned by a write, if they belong on screen. */
  upsertEntries(entries) {
    if (upsertInto(this, entries)) {
      this.sorted = null;
      this.renderRows();
    }
  }

  async deleteEntry(entry, error) {
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
    const rows = [...this.tbody.querySelectorAll("tr[data-path]")];
    const index = rows.findIndex((r) => r.dataset.path === entry.path);
    if (error) error.textContent = "";
    try {
      await folder.api.operation({ action: "delete", path: entry.path });
    } catch (err) {
      const message = `Could not delete ${name}: ${folder.explain(err)}`;
      if (error && error.isConnected) error.textContent = message;
      else this.error.textContent = message;
      return;
    }
    this.entries = this.entries.filter((e) => !isWithin(e.path, entry.path));
    this.rowCache.delete(entry.path);
    this.selected.delete(entry.path);
    this.total = Math.max(0, this.total - 1);
    this.sorted = null;
    this.renderRows();
    folder.preview.closeIfWithin(entry.path);
    folder.announce(`Moved ${name} to Trash.`);
    folder.refreshSync();
    // Focus the row that took the deleted one's place (or the one before it).
    this.focusAfterChange(Math.max(0, index));
  }
}
