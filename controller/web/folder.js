// One work folder's page. It lays out the views and routes between them;
// each view is its own module and reaches the others through this page:
//
//   listing.js    the files view (breadcrumbs, table, paging, filter, delete);
//                 its column sorts are sorting.js
//   newfolder.js  the files view's "New folder" form
//   uploads.js    upload button, drag-and-drop, the upload queue
//   preview.js    the preview view (?preview=path)
//   editor.js     the editor view (?edit=path), and an agent's "Instructions"
//   trash.js      the trash view (batches, restore, restore as, purge)
//   sync.js       the sync panel (last change, agent runs, refresh requests)
//   live.js       polls the folder's changes and refreshes what is on screen
//   repos.js      a task folder's repositories (last save, state, tar download)

import { ApiError, FolderApi, agentInfo } from "./api.js";
import { clear, h, uid } from "./dom.js";
import { Editor } from "./editor.js";
import { Listing } from "./listing.js";
import { LiveUpdates } from "./live.js";
import { Preview } from "./preview.js";
import { RepoPanel } from "./repos.js";
import { SyncPanel } from "./sync.js";
import { Trash } from "./trash.js";
import { Uploads } from "./uploads.js";

export const SCOPES = ["task", "agent", "user", "project"];

// Shown for a missing folder and for one the user may not see, alike: the
// API answers both with the same 404 so that folders cannot be probed, and
// the page must not undo that by rendering them differently.
const NOT_FOUND_TEXT = "This folder doesn't exist or you don't have access";

const SCOPE_LABEL = { task: "Task", agent: "Agent", project: "Project", user: "User" };
const STATUS_MS = 10000;

export class FolderPage {
  constructor(root, route, { session, navigate, directoryFor, validScope }) {
    this.root = root;
    this.route = route;
    this.session = session;
    this.navigate = navigate;
    this.directoryFor = directoryFor;
    this.validScope = validScope;
    this.api = new FolderApi(route.companyId, route.scope, route.ownerId);
    this.company = session.companies.find((c) => c.id === route.companyId) || null;
    this.readOnly = !this.company || this.company.role === "viewer";
    this.destroyed = false;
    this.statusTimer = null;
    this.dir = route.dir;
    this.view = route.view;
    this.ownerName = null;
    // The views below exist once the folder's first listing has loaded.
    this.listing = null;
    this.uploads = null;
    this.preview = null;
    this.editor = null;
    this.entryPath = null; // an agent folder's instruction entry, once known
    this.trash = null;
    this.sync = null;
    this.repos = null;
    this.live = null;
    this.onKey = (event) => {
      // Escape closes the preview unless a dialog or menu has it.
      if (event.key !== "Escape" || !this.preview?.path || event.defaultPrevented) return;
      if (document.querySelector("dialog[open]")) return;
      event.preventDefault();
      this.closePreview();
    };
    document.addEventListener("keydown", this.onKey);
  }

  sameFolder(route) {
    return (
      route.companyId === this.route.companyId &&
      route.scope === this.route.scope &&
      route.ownerId === this.route.ownerId
    );
  }

  destroy() {
    this.destroyed = true;
    clearTimeout(this.statusTimer);
    document.removeEventListener("keydown", this.onKey);
    this.sync?.stop();
    this.repos?.stop();
    this.live?.stop();
    this.preview?.revokeUrl();
    this.editor?.destroy();
    this.uploads?.abortAll();
  }

  dirUrl(dir) {
    const base = location.pathname;
    return dir ? `${base}?${new URLSearchParams({ dir })}` : base;
  }

  /** The address of a file's preview: its directory's URL plus ?preview=path. */
  previewUrl(path) {
    const q = new URLSearchParams();
    if (this.dir) q.set("dir", this.dir);
    q.set("preview", path);
    return `${location.pathname}?${q}`;
  }

  openPreview(path) {
    this.navigate(this.previewUrl(path));
  }

  /** The address of a file's editor: its directory's URL plus ?edit=path. */
  editUrl(path) {
    const q = new URLSearchParams();
    if (this.dir) q.set("dir", this.dir);
    q.set("edit", path);
    return `${location.pathname}?${q}`;
  }

  /** Back to the directory's address; focus returns to the file's row. */
  closeEditor() {
    const path = this.editor.path;
    this.navigate(this.dirUrl(this.dir));
    if (path) this.listing.focusPath(path);
  }

  /** Back to the directory's address; focus returns to the file's row. */
  closePreview() {
    const path = this.preview.path;
    this.navigate(this.dirUrl(this.dir));
    if (path) this.listing.focusPath(path);
  }

  /** Change query parameters in place (page, filter): no new history entry. */
  replaceParams(changes) {
    const q = new URLSearchParams(location.search);
    for (const [key, value] of Object.entries(changes)) {
      if (value === null || value === "") q.delete(key);
      else q.set(key, value);
    }
    const search = q.toString();
    history.replaceState(null, "", search ? `${location.pathname}?${search}` : location.pathname);
  }

  trashUrl() {
    return `${location.pathname}?view=trash`;
  }

  /** The message for a failed API call; anything but an ApiError is a bug and rethrown. */
  explain(err) {
    if (!(err instanceof ApiError)) throw err;
    return err.code === "not_found" ? NOT_FOUND_TEXT : err.message;
  }

  /**
   * A status message over the bottom edge; it clears itself after STATUS_MS,
   * so it never stays over a row a finger needs (the change it reports is on
   * the page anyway).
   */
  announce(text) {
    clearTimeout(this.statusTimer);
    this.status.textContent = text;
    if (text) this.statusTimer = setTimeout(() => (this.status.textContent = ""), STATUS_MS);
  }

  refreshSync() {
    this.sync?.refresh();
    this.repos?.refresh();
  }

  /**
   * A write started from a row's button (delete, restore, purge): the button
   * stays disabled while it runs and after it succeeds, when `applied` updates
   * the page before `success` is announced; a failure re-enables the button
   * and puts `failure(err)` in the row's `error` line.
   */
  async rowOperation(body, { button, error, applied, success, failure }) {
    error.textContent = "";
    button.disabled = true;
    try {
      await this.api.operation(body);
    } catch (err) {
      button.disabled = false;
      error.textContent = failure(err);
      return;
    }
    applied();
    this.announce(success);
    this.refreshSync();
  }

  /** The name of the folder's top directory, in breadcrumbs and captions. */
  rootLabel() {
    return this.ownerName || `${SCOPE_LABEL[this.route.scope]} folder`;
  }

  // --- start-up -------------------------------------------------------------

  async start() {
    document.title = "Files";
    clear(this.root).append(h("p", { class: "muted", role: "status", text: "Loading folder…" }));
    if (!this.validScope) {
      this.renderNotFound();
      return;
    }
    let first;
    try {
      first =
        this.view === "trash"
          ? await this.api.list({ trash: true })
          : await this.api.list({ dir: this.dir, name: this.route.q });
    } catch (err) {
      if (this.destroyed) return;
      if (!(err instanceof ApiError)) throw err;
      // A malformed address (bad UUID, bad dir) is as unreachable as a
      // missing folder; a 401 has already switched to the sign-in form.
      if (err.status === 404 || (err.status === 400 && !this.dir)) this.renderNotFound();
      else if (err.status !== 401) this.renderLoadError(err);
      return;
    }
    if (this.destroyed) return;
    this.buildSkeleton();
    if (this.view === "trash") {
      this.trash.acceptPage(first, true);
      this.trash.fresh = true;
    } else {
      this.listing.acceptPage(first, this.dir, true);
      this.listing.openWantedPage();
    }
    this.sync.showFilesUpdated(first.lastOperationAt);
    this.applyView(true);
    if (this.route.preview || this.route.edit) this.applyPreview();
    if (this.route.scope === "agent") this.loadAgent();
    this.resolveNames();
    this.refreshSync();
    this.sync.startPolling();
    this.repos?.startPolling();
    this.live = new LiveUpdates(this);
    this.live.start();
  }

  /** An agent folder names its instruction entry: "Instructions" opens it in the editor. */
  async loadAgent() {
    let info;
    try {
      info = await agentInfo(this.route.companyId, this.route.ownerId);
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      return; // the folder's own listing already says what is wrong
    }
    if (this.destroyed) return;
    this.entryPath = info.entryPath;
    const link = h("a", {
      class: "button-link instructions",
      href: this.editUrl(info.entryPath),
      "data-nav": true,
      "aria-label": `Instructions: edit ${info.entryPath}`,
      text: "Instructions",
    });
    // Dir changes rebuild the link's address (its ?dir= follows the listing).
    link.addEventListener("click", () => link.setAttribute("href", this.editUrl(info.entryPath)));
    this.headActions.replaceChildren(link);
  }

  renderNotFound() {
    document.title = "Folder not found · Files";
    const heading = h("h1", { tabindex: "-1", text: "Folder not found" });
    clear(this.root).append(
      heading,
      h("p", { class: "error", role: "alert", text: NOT_FOUND_TEXT }),
      h("p", {}, h("a", { href: "/files/", "data-nav": true, text: "Go to your files" })),
    );
    heading.focus();
  }

  renderLoadError(err) {
    clear(this.root).append(
      h("h1", { tabindex: "-1", text: "Files" }),
      h("p", { class: "error", role: "alert", text: `Could not load this folder: ${err.message}` }),
      h("p", {}, h("button", { type: "button", onClick: () => this.start() }, "Try again")),
    );
  }

  /** The owner's display name (the sync panel has its agents' names from /sync). */
  async resolveNames() {
    const { scope, ownerId, companyId } = this.route;
    let directory = null;
    try {
      directory = await this.directoryFor(companyId);
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
    }
    if (this.destroyed) return;
    let name = null;
    if (scope === "user") {
      name = ownerId === this.session.userId ? "My files" : "User files";
    } else if (directory) {
      const list = { task: directory.tasks, agent: directory.agents, project: directory.projects }[
        scope
      ];
      const item = list.find((x) => x.id === ownerId);
      if (item) name = item.title || item.name;
    }
    this.ownerName = name;
    this.renderTitle();
    this.listing.renderBreadcrumbs();
  }

  // --- layout ---------------------------------------------------------------

  buildSkeleton() {
    const ids = {
      title: uid("folder-title"),
      files: uid("files-heading"),
      trash: uid("trash-heading"),
      sync: uid("sync-heading"),
      preview: uid("preview-heading"),
      editor: uid("editor-heading"),
      editorText: uid("editor-text"),
      editorTheirs: uid("editor-theirs"),
      editorConflict: uid("editor-conflict"),
      exec: uid("exec"),
      filter: uid("filter"),
      folderName: uid("folder-name"),
      upload: uid("upload-input"),
      repos: uid("repos-heading"),
    };

    this.titleEl = h("h1", { id: ids.title, tabindex: "-1" });
    this.subtitleEl = h("p", { class: "muted subtitle" });
    this.headActions = h("div", { class: "head-actions" });
    this.status = h("p", { class: "status", role: "status", "aria-live": "polite" });

    this.filesTab = h("a", { href: this.dirUrl(""), "data-nav": true }, "Files");
    this.trashTab = h("a", { href: this.trashUrl(), "data-nav": true }, "Trash");
    const tabs = h(
      "nav",
      { class: "tabs", "aria-label": "Folder views" },
      h("ul", {}, h("li", {}, this.filesTab), h("li", {}, this.trashTab)),
    );

    // The files view holds the upload controls, so uploads come first.
    this.uploads = new Uploads(this, ids);
    this.listing = new Listing(this, ids);
    this.trash = new Trash(this, ids);
    this.sync = new SyncPanel(this, ids);
    this.preview = new Preview(this, ids);
    this.editor = new Editor(this, ids);
    this.repos = this.route.scope === "task" ? new RepoPanel(this, ids.repos) : null;

    clear(this.root).append(
      h("div", { class: "folder-head" }, this.titleEl, this.subtitleEl, this.headActions),
      tabs,
      this.status,
      h(
        "div",
        { class: "layout" },
        h(
          "div",
          { class: "primary" },
          this.editor.section,
          this.preview.section,
          this.listing.section,
          this.trash.section,
        ),
        h("div", { class: "secondary-col" }, this.sync.section, this.repos?.section || null),
      ),
      this.uploads.box,
    );
    this.renderTitle();
  }

  renderTitle() {
    const { scope } = this.route;
    const label = SCOPE_LABEL[scope];
    let title;
    if (scope === "user") title = this.ownerName || "User files";
    else title = this.ownerName ? `${label}: ${this.ownerName}` : `${label} files`;
    this.titleEl.textContent = title;
    const companyName = this.company ? this.company.name : "";
    const parts = [companyName, `${label.toLowerCase()} folder`].filter(Boolean);
    this.subtitleEl.textContent = parts.join(" · ");
    document.title = `${title} · Files`;
  }

  /** Called on in-page navigation within this folder (dir or view change). */
  show(route) {
    this.route = route;
    if (!this.listing) {
      // The folder never loaded (not found, or an error): try afresh.
      this.dir = route.dir;
      this.view = route.view;
      this.start();
      return;
    }
    // The trash URL names no directory; the files view keeps its own.
    const dirChanged = route.view === "files" && route.dir !== this.dir;
    const viewChanged = route.view !== this.view;
    if (route.view === "files") this.dir = route.dir;
    this.view = route.view;
    this.announce("");
    const previewChanged = (route.preview || null) !== (this.preview.path || null);
    const editChanged = (route.edit || null) !== (this.editor.path || null);
    this.applyView(dirChanged || viewChanged);
    if (previewChanged || editChanged || dirChanged || viewChanged) this.applyPreview();
  }

  /** Open or close the preview and the editor to match the URL's ?preview= and ?edit=. */
  applyPreview() {
    const files = this.view === "files";
    const edit = files ? this.route.edit : null;
    const path = files && !edit ? this.route.preview : null;
    if (edit) {
      this.preview.close();
      if (edit !== this.editor.path) {
        this.editor.openPath(edit, { create: edit === this.entryPath });
      }
      return;
    }
    this.editor.close();
    if (!path) {
      this.preview.close();
      return;
    }
    const entry = this.listing.entryAt(path);
    this.preview.openPath(path, entry);
  }

  applyView(moveFocus) {
    const trash = this.view === "trash";
    this.listing.section.hidden = trash;
    this.trash.section.hidden = !trash;
    this.filesTab.setAttribute("href", this.dirUrl(this.dir));
    if (trash) {
      this.trashTab.setAttribute("aria-current", "page");
      this.filesTab.removeAttribute("aria-current");
      this.trash.shown();
    } else {
      this.filesTab.setAttribute("aria-current", "page");
      this.trashTab.removeAttribute("aria-current");
      this.listing.showDir();
    }
    // Keyboard and screen reader users land on the main heading after every
    // navigation (the preview takes focus itself when it opens).
    const fileView = this.view === "files" && (this.route.preview || this.route.edit);
    if (moveFocus && !fileView) this.titleEl.focus();
  }
}
