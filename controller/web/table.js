// Pieces shared by the folder's two paged tables, the files listing and the
// trash: the pager, the range summary and the name cell.

import { PAGE_SIZE } from "./api.js";
import { h } from "./dom.js";

/** Previous/next buttons under a table that shows PAGE_SIZE rows at a time. */
export class Pager {
  constructor(onTurn) {
    this.prev = h(
      "button",
      { type: "button", class: "secondary", onClick: () => onTurn(-1) },
      "Previous page",
    );
    this.next = h(
      "button",
      { type: "button", class: "secondary", onClick: () => onTurn(1) },
      "Next page",
    );
    this.el = h("div", { class: "pager", hidden: true }, this.prev, this.next);
  }

  /** While a page is being fetched. */
  disable() {
    this.prev.disabled = this.next.disabled = true;
  }

  /**
   * Show the pager for the rows from `start` of `total` loaded ones; `more`
   * says the API has entries not fetched yet. Returns whether it is shown.
   */
  update(start, total, more) {
    const paged = total > PAGE_SIZE || more;
    this.el.hidden = !paged;
    this.prev.disabled = start === 0;
    this.next.disabled = start + PAGE_SIZE >= total && !more;
    return paged;
  }
}

/** The first row index to show: `start`, or the last page's once rows went away. */
export function clampStart(start, total) {
  if (start < total) return start;
  return Math.max(0, Math.floor((total - 1) / PAGE_SIZE) * PAGE_SIZE);
}

/** "1 entry", "1,234 entries". */
export function countText(n, one, many) {
  return n === 1 ? `1 ${one}` : `${n.toLocaleString()} ${many}`;
}

/** "Showing 1–200 of 230 entries." or "… of the first 200 entries; this directory has more." */
export function showingText(start, shown, count, more, holder) {
  const range = `${(start + 1).toLocaleString()}–${(start + shown).toLocaleString()}`;
  return more
    ? `Showing ${range} of the first ${count}; ${holder} has more.`
    : `Showing ${range} of ${count}.`;
}

/** An entry's icon and name ("docs/" for a directory); a link when `href` is given. */
export function entryName(kind, name, href = null) {
  const isDir = kind === "directory";
  const cls = `entry-name ${isDir ? "dir" : "file"}`;
  const icon = h("span", {
    class: `icon ${isDir ? "icon-dir" : "icon-file"}`,
    "aria-hidden": "true",
  });
  const label = isDir ? `${name}/` : name;
  return href
    ? h("a", { href, "data-nav": true, class: cls }, icon, label)
    : h("span", { class: cls }, icon, label);
}
