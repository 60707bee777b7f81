// Live updates: while the tab is visible, ask the folder every LIVE_POLL_MS
// whether anything changed since the version on screen (GET /changes, two
// index lookups on the server). Only when the directory shown (or, in the
// trash view, the folder) changed are its loaded pages fetched again; rows
// whose entry is unchanged keep their elements. Agent saves, other tabs and
// API clients all show up this way, and the sync panel follows.

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
    if (!trash && view.loadedFor === null) return;
    // The sync panel was loaded with the page: a change made before the first
    // poll is one it has not seen yet.
    if (!this.seen) this.seen = view.version;
    const changes = await folder.api.changes(view.version, trash ? null : view.loadedFor);
    if (folder.destroyed) return;
    if (changes.changed) {
      if (trash) await view.reload();
      else await view.reloadKeepingPlace();
    }
    // Nothing changed here up to this version: later polls can start from it.
    view.version = Math.max(view.version, changes.version);
    if (changes.version > this.seen) {
      folder.refreshSync();
      this.seen = changes.version;
    }
  }
}
