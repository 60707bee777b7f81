// Changes merged into the files view's loaded entries, so that neither a
// write of this page nor a change elsewhere fetches listing pages again:
// `upsertInto` takes the entries a write answered, `applyChanges` what
// GET /changes?entries=true says changed in the directory since the version
// on screen. Entries stay in the server's order (paths by code point, the
// byte order of their UTF-8); one past the last loaded page is left to that
// page's fetch, and only the total counts it.

import { baseName, parentDir } from "./dom.js";

/** The server's order of two paths: by code point, not by UTF-16 unit. */
export function comparePaths(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i += 1) {
    const x = a.codePointAt(i);
    const y = b.codePointAt(i);
    if (x !== y) return x < y ? -1 : 1;
    if (x > 0xffff) i += 1; // both are a surrogate pair here
  }
  return a.length - b.length;
}

/** Place `entry` in server order; false when it belongs to a page not fetched yet. */
function place(listing, entry) {
  const { entries } = listing;
  if (listing.sort) {
    entries.push(entry); // every entry is loaded; the display order is sorted anyway
    return true;
  }
  if (listing.cursor && listing.loadedUpTo !== null && comparePaths(entry.path, listing.loadedUpTo) > 0) {
    return false;
  }
  const at = entries.findIndex((e) => comparePaths(e.path, entry.path) > 0);
  if (at < 0) entries.push(entry);
  else entries.splice(at, 0, entry);
  return true;
}

/** Entries a write answered, where they belong on screen; true when any did. */
export function upsertInto(listing, written) {
  let changed = false;
  for (const entry of written) {
    if (entry.deletedAt || parentDir(entry.path) !== listing.loadedFor) continue;
    if (listing.name && !baseName(entry.path).toLowerCase().includes(listing.name.toLowerCase())) {
      continue;
    }
    const i = listing.entries.findIndex((e) => e.path === entry.path);
    if (i >= 0) listing.entries[i] = entry;
    else if (place(listing, entry)) listing.total += 1;
    else continue;
    changed = true;
  }
  return changed;
}

/**
 * A /changes answer with entries (its `complete` is true): entries trashed
 * or moved out go, written, restored and moved-in ones take their place,
 * and the directory's total is the server's.
 */
export function applyChanges(listing, delta) {
  const live = delta.entries.filter((e) => !e.deletedAt && parentDir(e.path) === listing.loadedFor);
  const ids = new Set(delta.entries.map((e) => e.id));
  const paths = new Set([...delta.gone, ...live.map((e) => e.path)]);
  listing.entries = listing.entries.filter((e) => !ids.has(e.id) && !paths.has(e.path));
  for (const entry of live) place(listing, entry);
  const known = new Set(listing.entries.map((e) => e.path));
  for (const path of [...listing.selected]) if (!known.has(path)) listing.selected.delete(path);
  for (const path of [...listing.rowCache.keys()]) if (!known.has(path)) listing.rowCache.delete(path);
  listing.total = delta.total;
  listing.sorted = null;
}
