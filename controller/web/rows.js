// One row of the files listing: a selection checkbox, the name (a link that
// opens the directory or the file's preview), size, modified, executable, a
// primary action (Download or Open) and a menu with the rest.
//
// Rows use a roving tabindex (keys.js): only the active row's controls are
// in the Tab order, so Tab jumps from the toolbar to the listing and out
// again instead of stopping at every button of every row.

import { baseName, formatSize, h, timeElement } from "./dom.js";
import { MenuButton } from "./menu.js";
import { entryName } from "./table.js";

/** Put the row's own controls in (true) or out of the Tab order. */
export function setRowTabbable(tr, on) {
  for (const el of tr.querySelectorAll("a, button, input")) {
    if (!el.closest(".menu")) el.tabIndex = on ? 0 : -1;
  }
}

/** The row's name link: what arrow keys move focus to. */
export function rowLink(tr) {
  return tr.querySelector(".col-name a");
}

export function buildRow(listing, entry) {
  const { folder } = listing;
  const name = baseName(entry.path);
  const isDir = entry.kind === "directory";
  const error = h("p", { class: "error row-error", role: "alert" });
  const href = isDir ? folder.dirUrl(entry.path) : folder.previewUrl(entry.path);
  const link = entryName(entry.kind, name, href);
  link.setAttribute("aria-label", isDir ? `Open folder ${name}` : `Open ${name}`);
  const size = isDir ? "—" : formatSize(entry.byteSize);
  const nameCell = h(
    "th",
    { scope: "row", class: "col-name" },
    link,
    // Shown instead of the size and date columns on narrow screens.
    h(
      "span",
      { class: "row-meta muted", "aria-hidden": "true" },
      isDir ? "Folder" : size,
      !isDir && entry.executable ? " · Executable" : null,
      entry.updatedAt ? [" · ", timeElement(entry.updatedAt, "")] : null,
    ),
  );
  const select = h("input", {
    type: "checkbox",
    class: "row-select",
    "aria-label": `Select ${name}`,
  });
  select.checked = listing.selected.has(entry.path);
  select.addEventListener("change", () => listing.toggleSelected(entry.path, select.checked));

  const primary = isDir
    ? h("a", {
        class: "button-link small primary-action",
        href,
        "data-nav": true,
        "aria-label": `Open ${name}`,
        text: "Open",
      })
    : h("a", {
        class: "button-link small primary-action",
        href: folder.api.contentUrl(entry.path),
        download: name,
        "aria-label": `Download ${name}`,
        text: "Download",
      });
  const items = [];
  if (!isDir) {
    items.push({ label: "Preview", onSelect: () => folder.openPreview(entry.path) });
    items.push({ label: "Download", href: folder.api.contentUrl(entry.path), download: name });
  }
  if (!folder.readOnly) {
    items.push(
      { label: "Rename…", onSelect: () => listing.ops.rename(entry), keepsFocus: true },
      { label: "Move…", onSelect: () => listing.ops.move([entry]), keepsFocus: true },
      {
        label: "Delete…",
        danger: true,
        onSelect: () => listing.deleteEntry(entry, error),
        keepsFocus: true,
      },
    );
  }
  const menu = new MenuButton(`Actions for ${name}`, items);
  const tr = h(
    "tr",
    { dataset: { path: entry.path, kind: entry.kind } },
    h("td", { class: "col-select" }, h("label", { class: "check-target" }, select)),
    nameCell,
    h("td", {
      class: "col-size",
      dataset: { bytes: isDir ? "" : String(entry.byteSize) },
      text: size,
    }),
    h("td", { class: "col-modified" }, timeElement(entry.updatedAt, "—")),
    h("td", { class: "col-exec", text: isDir ? "—" : entry.executable ? "Yes" : "No" }),
    h(
      "td",
      { class: "col-actions" },
      h("div", { class: "row-actions" }, primary, menu.wrap),
      error,
    ),
  );
  setRowTabbable(tr, false);
  return { tr, error };
}
