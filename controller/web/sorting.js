// The listing's column sorts: directories first either way, ties by name in
// a natural order (file2 before file10).

import { baseName } from "./dom.js";

export const SORT_LABEL = {
  name: "Name",
  size: "Size",
  modified: "Modified",
  executable: "Executable",
};
const NAME_ORDER = new Intl.Collator(undefined, { numeric: true, sensitivity: "base" });

const SORT_VALUE = {
  name: () => 0,
  size: (e) => e.byteSize || 0,
  modified: (e) => Date.parse(e.updatedAt) || 0,
  executable: (e) => (e.executable ? 1 : 0),
};

/** `entries` sorted by `sort`; directories first either way, ties by name. */
export function sortEntries(entries, { key, ascending }) {
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
