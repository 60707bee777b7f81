// The trash view: deleted entries grouped into batches (everything deleted
// together, or the previous content of a replaced file), paged PAGE_SIZE
// batches at a time, with Restore, Restore as… (the way out of a collision)
// and Purge.

import { ApiError, PAGE_SIZE } from "./api.js";
import { askText, confirmAction } from "./dialog.js";
import { baseName, formatSize, h, parentDir, plural, timeElement } from "./dom.js";
import { Pager, clampStart, countText, entryName, showingText } from "./table.js";

export class Trash {
  constructor(folder, ids) {
    this.folder = folder;
    this.entries = [];
    this.cursor = null;
    this.start = 0; // index of the first batch shown
    this.seq = 0; // discards answers to superseded listing requests
    this.fresh = false; // the first page arrived with the page itself
    this.version = 0; // the folder version the loaded trash shows
    this.section = this.build(ids);
  }

  build(ids) {
    this.heading = h("h2", { id: ids.trash, tabindex: "-1", text: "Trash" });
    this.tbody = h("tbody");
    this.summary = h("p", { class: "muted list-summary" });
    this.pager = new Pager((step) => this.turnPage(step));
    this.error = h("p", { class: "error", role: "alert" });
    const table = h(
      "table",
      { class: "listing trash" },
      h("caption", { class: "sr-only", text: "Deleted items" }),
      h(
        "thead",
        {},
        h(
          "tr",
          {},
          h("th", { scope: "col", text: "Name" }),
          h("th", { scope: "col", text: "Items" }),
          h("th", { scope: "col", class: "col-size", text: "Size" }),
          h("th", { scope: "col", text: "Deleted" }),
          h("th", { scope: "col", class: "col-actions", text: "Actions" }),
        ),
      ),
      this.tbody,
    );
    return h(
      "section",
      { class: "trash-view", "aria-labelledby": ids.trash, hidden: true },
      this.heading,
      h("p", {
        class: "muted",
        text: "Deleted items stay here until they are purged. Restoring brings back the item together with everything deleted with it.",
      }),
      h("div", { class: "table-scroll" }, table),
      h("div", { class: "list-footer" }, this.summary, this.pager.el),
      this.error,
    );
  }

  /** The trash view was opened: load it afresh unless its first page just came. */
  shown() {
    if (this.fresh) this.fresh = false;
    else this.reload();
  }

  async reload() {
    const seq = ++this.seq;
    this.error.textContent = "";
    try {
      const page = await this.folder.api.list({ trash: true });
      if (seq !== this.seq || this.folder.destroyed) return;
      this.acceptPage(page, true);
    } catch (err) {
      if (seq !== this.seq) return;
      this.error.textContent = `Could not load the trash: ${this.folder.explain(err)}`;
    }
  }

  /**
   * Show another page of batches. Entries arrive newest deletion first, so a
   * batch is complete once a later one has started; fetch until the target
   * page is full and its last batch complete, or the trash is exhausted.
   */
  async turnPage(step) {
    const target = this.start + step * PAGE_SIZE;
    if (target < 0) return;
    const seq = this.seq;
    this.pager.disable();
    try {
      while (this.cursor && this.batches().length <= target + PAGE_SIZE) {
        const page = await this.folder.api.list({ trash: true, cursor: this.cursor });
        if (seq !== this.seq || this.folder.destroyed) return;
        this.acceptPage(page, false, false);
      }
      if (target < this.batches().length) this.start = target;
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      this.error.textContent = `Could not load more of the trash: ${this.folder.explain(err)}`;
    } finally {
      if (seq === this.seq) this.render();
    }
  }

  acceptPage(page, reset, render = true) {
    if (reset) {
      this.entries = [];
      this.start = 0;
    }
    this.entries.push(...page.entries);
    this.cursor = page.nextCursor;
    this.version = Math.max(this.version, page.version || 0);
    if (render) this.render();
  }

  /** Entries deleted together (same trash root and time) form one batch. */
  batches() {
    const batches = new Map();
    for (const entry of this.entries) {
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

  render() {
    const batches = this.batches();
    const total = batches.length;
    this.start = clampStart(this.start, total);
    const shown = batches.slice(this.start, this.start + PAGE_SIZE);
    const fragment = document.createDocumentFragment();
    for (const batch of shown) {
      // The newest-loaded batch may continue on a page not fetched yet.
      const partial = Boolean(this.cursor) && batch === batches[total - 1];
      fragment.append(this.row(batch, partial));
    }
    if (!total) {
      fragment.append(
        h("tr", { class: "empty" }, h("td", { colspan: "5", text: "Trash is empty." })),
      );
    }
    this.tbody.replaceChildren(fragment);
    const more = Boolean(this.cursor);
    const paged = this.pager.update(this.start, total, more);
    const count = countText(total, "deleted item", "deleted items");
    this.summary.textContent = paged
      ? showingText(this.start, shown.length, count, more, "the trash")
      : "";
  }

  row(batch, partial = false) {
    const { root } = batch;
    const name = root.path;
    const isDir = root.kind === "directory";
    const inside = batch.entries.length - 1;
    const error = h("p", { class: "error row-error", role: "alert" });
    const actions = h("div", { class: "row-actions" });
    if (!this.folder.readOnly) {
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
      const restoreAs = h(
        "button",
        { type: "button", class: "small", "aria-label": `Restore ${name} as…` },
        "Restore as…",
      );
      restore.addEventListener("click", () => this.restore(batch, restore, error));
      restoreAs.addEventListener("click", () => this.restoreAs(batch, restoreAs, error));
      purge.addEventListener("click", () => this.purge(batch, purge, error, partial));
      actions.append(restore, restoreAs, purge);
    }
    return h(
      "tr",
      { dataset: { path: root.path, kind: root.kind } },
      h("th", { scope: "row", class: "col-name" }, entryName(root.kind, name)),
      h("td", {
        class: "col-items",
        text: isDir ? `Folder with ${partial ? "at least " : ""}${plural(inside, "item")}` : "1 file",
      }),
      h("td", {
        class: isDir ? "col-size no-size" : "col-size",
        text: isDir ? "—" : formatSize(root.byteSize),
      }),
      h(
        "td",
        { class: "col-deleted" },
        // The column header says this on wide screens; cards have no header.
        h("span", { class: "narrow-label", text: "Deleted " }),
        timeElement(batch.deletedAt, "—"),
      ),
      h("td", { class: "col-actions" }, actions, error),
    );
  }

  drop(batch) {
    const ids = new Set(batch.entries.map((e) => e.id));
    this.entries = this.entries.filter((e) => !ids.has(e.id));
    this.render();
  }

  async restore(batch, button, error) {
    const { folder } = this;
    const name = batch.root.path;
    await folder.rowOperation(
      { action: "restore", fileId: batch.rootId },
      {
        button,
        error,
        applied: () => {
          this.drop(batch);
          folder.listing.invalidate(); // the files view reloads when shown again
        },
        success: `Restored ${name}.`,
        failure: (err) =>
          err instanceof ApiError && err.code === "restore_collision"
            ? // The message names the occupied paths; say what to do about it.
              `${err.message}. Use Restore as… to bring it back under another name, or move or delete what is there now.`
            : `Could not restore ${name}: ${folder.explain(err)}`,
      },
    );
  }

  async restoreAs(batch, button, error) {
    const { folder } = this;
    const name = batch.root.path;
    const base = baseName(name);
    const dot = base.lastIndexOf(".");
    const suggested =
      batch.root.kind === "file" && dot > 0
        ? `${base.slice(0, dot)} (restored)${base.slice(dot)}`
        : `${base} (restored)`;
    const answer = await askText({
      title: `Restore ${name} as`,
      message: "The restored item gets this path; everything deleted with it comes along.",
      label: "Restore to (path in this folder)",
      value: parentDir(name) ? `${parentDir(name)}/${suggested}` : suggested,
      confirmLabel: "Restore",
      check: (text) => (text ? "" : "Enter a path."),
    });
    if (answer === null) return;
    const to = answer.replace(/^\/+|\/+$/g, "");
    await folder.rowOperation(
      { action: "restore", fileId: batch.rootId, to },
      {
        button,
        error,
        applied: () => {
          this.drop(batch);
          folder.listing.invalidate();
        },
        success: `Restored ${name} as ${to}.`,
        failure: (err) => `Could not restore ${name} as ${to}: ${folder.explain(err)}`,
      },
    );
  }

  async purge(batch, button, error, partial = false) {
    const { folder } = this;
    const name = batch.root.path;
    const inside = batch.entries.length - 1;
    const contents = inside
      ? ` and ${partial ? "at least " : ""}${plural(inside, "item")} inside it`
      : "";
    const ok = await confirmAction({
      title: `Purge ${name}?`,
      message: `${name}${contents} will be deleted permanently. This cannot be undone.`,
      confirmLabel: "Purge permanently",
    });
    if (!ok) return;
    await folder.rowOperation(
      { action: "purge", fileId: batch.rootId },
      {
        button,
        error,
        applied: () => this.drop(batch),
        success: `Permanently deleted ${name}.`,
        failure: (err) => `Could not purge ${name}: ${folder.explain(err)}`,
      },
    );
  }
}
