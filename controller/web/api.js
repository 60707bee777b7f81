// The controller's REST API as the page uses it.
//
// Requests ride on the HttpOnly session cookie. Every write also carries the
// CSRF token handed out with the session: SameSite=Strict keeps the cookie
// off cross-site requests, and the header is something a cross-site form can
// never add, so both locks must be picked for a forged write to land.

let csrfToken = "";
let onUnauthenticated = null;

export function setCsrfToken(token) {
  csrfToken = token || "";
}

/** Called once whenever the API answers 401 (the session ended or expired). */
export function setUnauthenticatedHandler(handler) {
  onUnauthenticated = handler;
}

const NETWORK_ERROR = {
  error: "Could not reach the server. Check the connection and try again.",
  code: "network_error",
};

// Codes whose server message is terse or technical get plainer words here.
const PLAIN_MESSAGES = {
  csrf_failed: "The page's session check failed. Reload the page and try again.",
  unauthenticated: "You are signed out. Sign in again to continue.",
  payload_too_large: "The file is larger than the server accepts (1 GiB per file).",
  database_unavailable: "The server's database is unavailable right now. Try again shortly.",
  storage_unavailable: "File storage is unavailable right now. Try again shortly.",
  internal_error: "Something went wrong on the server. Try again.",
  target_exists: "Something with that name is already there. Pick another name.",
  move_into_itself: "A folder cannot be moved into itself.",
  precondition_failed: "The file changed in the meantime.",
  stale_save: "The file changed since you opened it.",
};

export class ApiError extends Error {
  constructor(status, body) {
    const data = body && typeof body === "object" ? body : {};
    super(describe(status, data));
    this.name = "ApiError";
    this.status = status;
    this.code = data.code || (status ? `http_${status}` : "network_error");
    this.details = Array.isArray(data.details) ? data.details : [];
  }
}

/** One plain sentence for an error body, including validation details. */
function describe(status, data) {
  if (data.code && PLAIN_MESSAGES[data.code]) {
    return PLAIN_MESSAGES[data.code];
  }
  let message = data.error || (status ? `The server answered ${status}` : NETWORK_ERROR.error);
  const details = Array.isArray(data.details) ? data.details : [];
  const messages = details.map((d) => d && d.message).filter(Boolean);
  const paths = details.map((d) => d && !d.message && d.path).filter(Boolean);
  if (messages.length) message = messages.map(sentence).join(" ");
  else if (paths.length) message = `${message}: ${paths.join(", ")}`;
  return message;
}

function sentence(text) {
  const s = String(text).trim();
  if (!s) return s;
  const first = s[0].toUpperCase() + s.slice(1);
  return /[.!?]$/.test(first) ? first : `${first}.`;
}

/** A random key for Idempotency-Key; works outside secure contexts too. */
export function newIdempotencyKey() {
  const bytes = new Uint8Array(16);
  crypto.getRandomValues(bytes);
  return "web-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

async function readErrorBody(resp) {
  try {
    return await resp.json();
  } catch {
    return null;
  }
}

/**
 * fetch() with the session conventions. `json` is sent as the body (or `body`
 * as it is), `as` picks the result: "json" (default), "bytes" (ArrayBuffer),
 * "response" (the Response, for its headers) or "none".
 * Non-2xx answers throw ApiError.
 */
export async function request(
  method,
  url,
  { json, body, headers = {}, as = "json", quiet401 = false } = {},
) {
  const init = { method, headers: { ...headers }, credentials: "same-origin", cache: "no-store" };
  if (method !== "GET" && method !== "HEAD") init.headers["X-CSRF-Token"] = csrfToken;
  if (json !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  } else if (body !== undefined) {
    init.body = body;
  }
  let resp;
  try {
    resp = await fetch(url, init);
  } catch {
    throw new ApiError(0, NETWORK_ERROR);
  }
  if (!resp.ok) {
    const err = new ApiError(resp.status, await readErrorBody(resp));
    if (resp.status === 401 && !quiet401 && onUnauthenticated) onUnauthenticated();
    throw err;
  }
  if (resp.status === 204 || as === "none") return null;
  if (as === "response") return resp;
  if (as === "bytes") return resp.arrayBuffer();
  return resp.json();
}

// --- session ----------------------------------------------------------------

export function getSession() {
  return request("GET", "/files/api/session", { quiet401: true });
}

export function signIn(token) {
  return request("POST", "/files/api/session", { json: { token }, quiet401: true });
}

export function signOut() {
  return request("DELETE", "/files/api/session", { quiet401: true });
}

export function companyDirectory(companyId) {
  return request("GET", `/api/companies/${encodeURIComponent(companyId)}/directory`);
}

/** An agent's instruction entry, storage limits and usage. */
export function agentInfo(companyId, agentId) {
  return request(
    "GET",
    `/api/companies/${encodeURIComponent(companyId)}/agents/${encodeURIComponent(agentId)}`,
  );
}

// --- one work folder --------------------------------------------------------

export const PAGE_SIZE = 200;
export const PREVIEW_LIMIT = 8 * 1024 * 1024;
export const UPLOAD_LIMIT = 1024 * 1024 * 1024;
export const EDITOR_LIMIT = 1024 * 1024;

export class FolderApi {
  constructor(companyId, scope, ownerId) {
    this.base =
      `/api/companies/${encodeURIComponent(companyId)}/work-folders/` +
      `${encodeURIComponent(scope)}/${encodeURIComponent(ownerId)}`;
  }

  /** One page of entries: direct children of `dir`, or the whole trash. */
  list({ dir = null, trash = false, cursor = null, limit = PAGE_SIZE, name = "" } = {}) {
    const q = new URLSearchParams({ trash: String(trash), limit: String(limit) });
    if (dir !== null) q.set("dir", dir);
    if (cursor) q.set("cursor", cursor);
    if (name) q.set("name", name);
    return request("GET", `${this.base}/?${q}`);
  }

  /** The entry at `path`, or null: one filtered listing of its directory. */
  async entry(path) {
    const i = path.lastIndexOf("/");
    const dir = i < 0 ? "" : path.slice(0, i);
    const page = await this.list({ dir, name: path.slice(i + 1), limit: 1000 });
    return page.entries.find((e) => e.path === path) || null;
  }

  /**
   * {version, changed}: whether `dir` (or, with null, anything) changed after
   * `since`; with `entries` (and a dir), when it changed, also its changed
   * entries, the paths moved out, its total under `name` and `complete`.
   */
  changes(since, dir = null, { entries = false, name = "" } = {}) {
    const q = new URLSearchParams({ since: String(since) });
    if (dir !== null) q.set("dir", dir);
    if (entries) q.set("entries", "true");
    if (name) q.set("name", name);
    return request("GET", `${this.base}/changes?${q}`);
  }

  move(path, to, key = newIdempotencyKey()) {
    return this.operation({ action: "move", path, to }, key);
  }

  contentUrl(path, { preview = false } = {}) {
    const q = new URLSearchParams({ path });
    if (preview) q.set("preview", "true");
    return `${this.base}/content?${q}`;
  }

  previewBytes(path) {
    return request("GET", this.contentUrl(path, { preview: true }), { as: "bytes" });
  }

  /**
   * A file's bytes and the digest they hash to (its ETag), or null when no
   * file is at `path`: what the editor loads and compares against.
   */
  async readFile(path) {
    let resp;
    try {
      resp = await request("GET", this.contentUrl(path), { as: "response" });
    } catch (err) {
      if (err instanceof ApiError && err.code === "file_not_found") return null;
      throw err;
    }
    const digest = (resp.headers.get("ETag") || "").replaceAll('"', "");
    return { digest, bytes: await resp.arrayBuffer() };
  }

  /**
   * The editor's save: replace a file with `bytes` in one request, based on
   * the version it read, `base` ("new": it read no file, else that version's
   * digest), sent as X-Base-Digest. A change in between answers 409
   * stale_save (spec/agent-files.md), never a silent overwrite.
   */
  saveEdit(path, bytes, { base, contentType = null, key = newIdempotencyKey() }) {
    const headers = { "Content-Type": "application/octet-stream", "Idempotency-Key": key };
    if (contentType) headers["X-File-Content-Type"] = contentType;
    headers["X-Base-Digest"] = base === "new" ? "none" : base;
    return request("PUT", this.contentUrl(path), { body: bytes, headers });
  }

  operation(body, key = newIdempotencyKey()) {
    return request("POST", `${this.base}/operations`, {
      json: body,
      headers: { "Idempotency-Key": key },
    });
  }

  sync() {
    return request("GET", `${this.base}/sync`);
  }

  requestRefresh(runId) {
    return request("POST", `${this.base}/refresh`, { json: { runId } });
  }

  /**
   * PUT one file with progress. XMLHttpRequest because fetch() reports no
   * upload progress. The caller keeps `key` and passes it again on retry, so
   * an upload that landed but whose answer was lost is not applied twice.
   */
  upload(path, file, { key, executable = false, condition = null, onProgress = () => {} }) {
    const xhr = new XMLHttpRequest();
    const promise = new Promise((resolve, reject) => {
      xhr.open("PUT", this.contentUrl(path));
      xhr.setRequestHeader("Content-Type", "application/octet-stream");
      xhr.setRequestHeader("X-CSRF-Token", csrfToken);
      xhr.setRequestHeader("Idempotency-Key", key);
      if (file.type) xhr.setRequestHeader("X-File-Content-Type", file.type);
      if (executable) xhr.setRequestHeader("X-File-Executable", "true");
      // "new": refuse to replace anything; a digest: replace only that content.
      if (condition === "new") xhr.setRequestHeader("If-None-Match", "*");
      else if (condition) xhr.setRequestHeader("If-Match", `"${condition}"`);
      xhr.upload.addEventListener("progress", (e) => {
        if (e.lengthComputable) onProgress(e.loaded, e.total);
      });
      xhr.addEventListener("load", () => {
        let body = null;
        try {
          body = JSON.parse(xhr.responseText);
        } catch {
          body = null;
        }
        if (xhr.status >= 200 && xhr.status < 300) {
          resolve(body);
          return;
        }
        if (xhr.status === 401 && onUnauthenticated) onUnauthenticated();
        reject(new ApiError(xhr.status, body));
      });
      xhr.addEventListener("error", () => reject(new ApiError(0, NETWORK_ERROR)));
      xhr.addEventListener("abort", () =>
        reject(new ApiError(0, { error: "Upload cancelled.", code: "aborted" })),
      );
      xhr.send(file);
    });
    return { promise, abort: () => xhr.abort() };
  }
}

// --- a task's repositories --------------------------------------------------

function taskReposBase(companyId, taskId) {
  return `/api/companies/${encodeURIComponent(companyId)}/tasks/${encodeURIComponent(taskId)}/repos`;
}

/** {repos: [...]}: each repository the task binds, with its last save. */
export function taskRepos(companyId, taskId) {
  return request("GET", taskReposBase(companyId, taskId));
}

/** The address of a repository's current checkpoint as a tar download. */
export function repoArchiveUrl(companyId, taskId, workspaceId) {
  return `${taskReposBase(companyId, taskId)}/${encodeURIComponent(workspaceId)}/archive`;
}
