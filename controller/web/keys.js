// Keyboard work in the files listing (a roving tabindex over the rows):
//
//   ArrowDown / ArrowUp, Home / End   move between rows
//   Enter                             opens (the focused name is a link)
//   Delete                            deletes, after a confirmation
//   F2                                renames
//
// Exactly one row is in the Tab order at a time: the active one.

import { rowLink, setRowTabbable } from "./rows.js";

export class RowKeys {
  constructor(listing) {
    this.listing = listing;
    this.active = null; // path of the row in the Tab order
    listing.tbody.addEventListener("keydown", (event) => this.onKey(event));
    listing.tbody.addEventListener("focusin", (event) => {
      const tr = event.target.closest("tr[data-path]");
      if (tr && !event.target.closest(".menu")) this.activate(tr);
    });
  }

  rows() {
    return [...this.listing.tbody.querySelectorAll("tr[data-path]")];
  }

  /** Make `tr` the row in the Tab order. */
  activate(tr) {
    for (const row of this.rows()) setRowTabbable(row, row === tr);
    this.active = tr ? tr.dataset.path : null;
  }

  /** After a render: keep the active row if it is still shown, else the first. */
  restore() {
    const rows = this.rows();
    const tr = rows.find((r) => r.dataset.path === this.active) || rows[0] || null;
    this.activate(tr);
  }

  /** Focus the row at `index` (clamped); false when the listing has no rows. */
  focusIndex(index) {
    const rows = this.rows();
    if (!rows.length) return false;
    const tr = rows[Math.max(0, Math.min(index, rows.length - 1))];
    this.activate(tr);
    rowLink(tr).focus();
    return true;
  }

  onKey(event) {
    if (event.target.closest(".menu") || event.altKey || event.ctrlKey || event.metaKey) return;
    const tr = event.target.closest("tr[data-path]");
    if (!tr) return;
    const rows = this.rows();
    const i = rows.indexOf(tr);
    const entry = this.listing.entryAt(tr.dataset.path);
    let handled = true;
    if (event.key === "ArrowDown") this.focusIndex(i + 1);
    else if (event.key === "ArrowUp") this.focusIndex(i - 1);
    else if (event.key === "Home") this.focusIndex(0);
    else if (event.key === "End") this.focusIndex(rows.length - 1);
    else if (event.key === "Delete" && entry && !this.listing.folder.readOnly) {
      this.listing.deleteEntry(entry, tr.querySelector(".row-error"));
    } else if (event.key === "F2" && entry && !this.listing.folder.readOnly) {
      this.listing.ops.rename(entry);
    } else handled = false;
    if (handled) event.preventDefault();
  }
}
