// Live updates: while the tab is visible, ask the folder every LIVE_POLL_MS
// what changed since the version on screen (GET /changes, index lookups on
// the server). In the files view the answer carries the shown directory's
// changed entries, which are merged into the loaded pages (listing.js
// refreshChanged, delta.js): no listing page is fetched again unless more
// changed than one answer holds. In the trash view a change in the folder
// lists the trash again. Rows whose entry is unchanged keep their elements.
// Agent saves, other tabs and API clients all show up this way, and the sync
// panel follows.

import { ApiError } from "./api.js";

const LIVE_POLL_MS = 2000;

export class LiveUpdates {
  constructor(folder) {
    this.folder = folder;
    this.timer = null;
    this.busy = false;
    this.seen = 0; // the newest folder version seen, for the sync panel
  }

  start() {
    clearInterval(this.timer);
    this.timer = setInterval(() => this.tick(), LIVE_POLL_MS);
  }

  stop() {
    clearInterval(this.timer);
  }

  async tick() {
    const { folder } = this;
    if (this.busy || document.hidden || folder.destroyed) return;
    this.busy = true;
    try {
      await this.check();
    } catch (err) {
      // A failed poll is retried at the next tick; the page stays as it is.
      if (!(err instanceof ApiError)) throw err;
    } finally {
      this.busy = false;
    }
  }

  async check() {
    const { folder } = this;
    const trash = folder.view === "trash";
    const view = trash ? folder.trash : folder.listing;
    if (!trash && view.loadedFor !== folder.dir) return;
    // The sync panel was loaded with the page: a change made before the first
    // poll is one it has not seen yet.
    if (!this.seen) this.seen = view.version;
    let version = null;
    if (trash) {
      const changes = await folder.api.changes(view.version, null);
      if (folder.destroyed) return;
      if (changes.changed) await view.reload();
      view.version = Math.max(view.version, changes.version);
      version = changes.version;
    } else {
      version = await view.refreshChanged();
    }
    if (folder.destroyed || version === null) return;
    if (version > this.seen) {
      folder.refreshSync();
      this.seen = version;
    }
  }
}
