// Rename and move from the files view, for one entry or a selection, and
// the selection's bulk delete and download. Each entry is its own API
// operation (one transaction each): a failure names the entry it hit and
// leaves the others done.

import { ApiError } from "./api.js";
import { askText, confirmAction } from "./dialog.js";
import { baseName, h, joinPath, parentDir, plural } from "./dom.js";

function checkName(name) {
  if (!name) return "Enter a name.";
  if (name.includes("/")) return "A name cannot contain /. Use Move to put it in another folder.";
  if (name === "." || name === "..") return "That name is reserved.";
  return "";
}

function checkFolder(path) {
  if (path.split("/").some((s) => s === "." || s === "..")) return "Use folder names, not . or ..";
  return "";
}

export class MoveOps {
  constructor(listing) {
    this.listing = listing;
    this.folder = listing.folder;
  }

  async rename(entry) {
    const name = baseName(entry.path);
    const answer = await askText({
      title: `Rename ${name}`,
      label: "New name",
      value: name,
      confirmLabel: "Rename",
      check: checkName,
    });
    if (answer === null || answer === name) return;
    const to = joinPath(parentDir(entry.path), answer);
    const failed = await this.moveOne(entry, to);
    if (failed) {
      this.listing.error.textContent = `Could not rename ${name}: ${failed}`;
      return;
    }
    this.folder.announce(`Renamed ${name} to ${answer}.`);
    // The row takes its new name at once and keeps focus through the reload
    // (which a live update may have started already).
    this.listing.replaceEntry(entry.path, this.moved);
    this.listing.focusPath(to);
    await this.listing.reloadKeepingPlace();
  }

  async move(entries) {
    if (!entries.length) return;
    const what = entries.length === 1 ? baseName(entries[0].path) : plural(entries.length, "item");
    const answer = await askText({
      title: `Move ${what}`,
      message: "Type the folder to move to, like reports/2024. Missing folders are created.",
      label: "Destination folder (empty for the top level)",
      value: this.folder.dir,
      confirmLabel: "Move",
      check: checkFolder,
    });
    if (answer === null) return;
    const dest = answer.replace(/^\/+|\/+$/g, "");
    const failures = [];
    let moved = 0;
    for (const entry of entries) {
      const to = joinPath(dest, baseName(entry.path));
      if (to === entry.path) continue;
      const failed = await this.moveOne(entry, to);
      if (failed) failures.push(`${baseName(entry.path)}: ${failed}`);
      else moved += 1;
    }
    this.listing.clearSelection();
    await this.listing.reloadKeepingPlace();
    this.listing.error.textContent = failures.length
      ? `Could not move ${failures.join("; ")}`
      : "";
    if (moved) this.folder.announce(`Moved ${plural(moved, "item")} to ${dest || "the top level"}.`);
    this.listing.focusAfterChange();
  }

  /** Move one entry; returns the error message, or "" when it moved (its new entries in `moved`). */
  async moveOne(entry, to) {
    this.moved = [];
    try {
      this.moved = (await this.folder.api.move(entry.path, to)).files || [];
    } catch (err) {
      return this.folder.explain(err);
    }
    this.folder.preview.closeIfWithin(entry.path);
    this.folder.refreshSync();
    return "";
  }

  async deleteSelected(entries) {
    if (!entries.length) return;
    const ok = await confirmAction({
      title: `Delete ${plural(entries.length, "item")}?`,
      message: `${entries.map((e) => baseName(e.path)).join(", ")} will move to Trash, folders with everything in them. You can restore them from Trash until they are purged.`,
      confirmLabel: "Delete",
    });
    if (!ok) return;
    const failures = [];
    for (const entry of entries) {
      try {
        await this.folder.api.operation({ action: "delete", path: entry.path });
        this.folder.preview.closeIfWithin(entry.path);
      } catch (err) {
        if (!(err instanceof ApiError)) throw err;
        failures.push(`${baseName(entry.path)}: ${this.folder.explain(err)}`);
      }
    }
    this.listing.clearSelection();
    await this.listing.reloadKeepingPlace();
    this.listing.error.textContent = failures.length
      ? `Could not delete ${failures.join("; ")}`
      : "";
    const done = entries.length - failures.length;
    if (done) this.folder.announce(`Moved ${plural(done, "item")} to Trash.`);
    this.folder.refreshSync();
    this.listing.focusAfterChange();
  }

  /**
   * Several downloads, one per selected file (no zip: each file arrives with
   * its own name and bytes as stored). Folders are skipped and said so.
   */
  downloadSelected(entries) {
    const files = entries.filter((e) => e.kind === "file");
    for (const entry of files) {
      const link = h("a", {
        href: this.folder.api.contentUrl(entry.path),
        download: baseName(entry.path),
        hidden: true,
      });
      document.body.append(link);
      link.click();
      link.remove();
    }
    const skipped = entries.length - files.length;
    this.folder.announce(
      `Downloading ${plural(files.length, "file")}` +
        (skipped ? `; ${plural(skipped, "folder")} skipped (open a folder to download its files).` : "."),
    );
  }
}
