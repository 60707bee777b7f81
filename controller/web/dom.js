// Small DOM and formatting helpers shared by the page modules.
//
// The page is served with a strict Content-Security-Policy (no inline
// scripts or style attributes), so elements are built here with properties
// and classes only; `h` never writes a `style` attribute.

/**
 * Build an element. `attrs` keys:
 *   class, text, dataset (object), on<Event> (listener), boolean values
 *   (set/removed as empty attributes), anything else via setAttribute.
 * Children may be nodes, strings, or null/false (skipped).
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "text") el.textContent = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2).toLowerCase(), value);
    } else if (value === true) el.setAttribute(key, "");
    else el.setAttribute(key, String(value));
  }
  append(el, children);
  return el;
}

export function append(parent, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    parent.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return parent;
}

export function clear(el) {
  el.replaceChildren();
  return el;
}

let idCounter = 0;
/** A document-unique id for label/control pairs. */
export function uid(prefix = "id") {
  idCounter += 1;
  return `${prefix}-${idCounter}`;
}

const UNITS = ["KiB", "MiB", "GiB", "TiB"];

/** "1 byte", "512 bytes", "2.9 KiB", "1.0 GiB". */
export function formatSize(bytes) {
  if (bytes === null || bytes === undefined) return "";
  if (bytes === 1) return "1 byte";
  if (bytes < 1024) return `${bytes} bytes`;
  let value = bytes / 1024;
  let unit = 0;
  while (value >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(1)} ${UNITS[unit]}`;
}

const DATE_FORMAT = new Intl.DateTimeFormat(undefined, {
  dateStyle: "medium",
  timeStyle: "medium",
});

/** A <time> element for an ISO timestamp, or `fallback` text when there is none. */
export function timeElement(iso, fallback = "never") {
  if (!iso) return h("span", { class: "muted", text: fallback });
  const date = new Date(iso);
  if (Number.isNaN(date.getTime())) return h("span", { text: iso });
  return h("time", { datetime: iso, title: iso, text: DATE_FORMAT.format(date) });
}

/** Last path segment: "a/b/c.txt" -> "c.txt". */
export function baseName(path) {
  const i = path.lastIndexOf("/");
  return i < 0 ? path : path.slice(i + 1);
}

/** Parent directory path: "a/b/c.txt" -> "a/b", "c.txt" -> "". */
export function parentDir(path) {
  const i = path.lastIndexOf("/");
  return i < 0 ? "" : path.slice(0, i);
}

export function joinPath(dir, name) {
  return dir ? `${dir}/${name}` : name;
}

/** True when `path` is `root` or lies below it. */
export function isWithin(path, root) {
  return path === root || path.startsWith(`${root}/`);
}

/** "1 file", "3 files". */
export function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

/** True when a drag event carries files (not text or a link). */
export function carriesFiles(event) {
  return Boolean(event.dataTransfer) && [...event.dataTransfer.types].includes("Files");
}
