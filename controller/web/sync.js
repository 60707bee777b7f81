// The sync panel: when the folder last changed directly and when an agent
// last saved it, and each agent run bound to the folder with its state in
// words that match the run, its own last save of this folder, and a
// "Request refresh" button. Polled every SYNC_POLL_MS while the tab is
// visible, and at once when live.js sees the folder change.

import { ApiError } from "./api.js";
import { h, timeElement } from "./dom.js";

const SYNC_POLL_MS = 15000;
const RUN_STATE_LABEL = {
  starting: "Starting",
  saving: "Saving",
  saved: "Saved",
  failed: "Save failed",
};

const PENDING_REFRESH =
  "Refresh requested: waiting for the agent. It takes this folder's new files at its next safe point, and the request clears once it has.";

/**
 * {key, text, reason}: the run's state in words, for this folder. A run that
 * saved other folders but never this one does not read "Saved" here, and an
 * ended run that never saved this folder says why.
 */
function runState(run) {
  const savedHere = Boolean(run.folderSavedAt);
  if (run.active) {
    if (run.state === "saved" && !savedHere) return { key: "starting", text: "Running — not saved here yet" };
    return { key: run.state, text: RUN_STATE_LABEL[run.state] || run.state };
  }
  if (run.state === "failed") return { key: "failed", text: "Ended — save failed" };
  if (run.state === "saving") return { key: "failed", text: "Ended while saving" };
  if (!savedHere) {
    const reason = run.lastSavedAt
      ? "The run saved its other folders, never this one."
      : "The run ended before it saved anything.";
    return { key: "failed", text: "Ended — not saved", reason: run.error || reason };
  }
  return { key: "saved", text: "Ended — saved" };
}

export class SyncPanel {
  constructor(folder, ids) {
    this.folder = folder;
    this.runItems = null; // runId -> {key, li}
    this.timer = null;
    this.section = this.build(ids);
  }

  build(ids) {
    this.filesUpdated = h("span", { class: "files-updated-value" });
    // Filled from /sync, which the page asks for once the listing is there.
    this.agentUpdated = h("span", { class: "agent-updated-value muted", text: "loading…" });
    this.runList = h("ul", { class: "runs" });
    this.error = h("p", { class: "error", role: "alert" });
    return h(
      "section",
      { class: "card sync", "aria-labelledby": ids.sync },
      h("h2", { id: ids.sync, text: "Sync" }),
      h(
        "p",
        { class: "files-updated" },
        h("span", { class: "sync-label", text: "Direct changes: " }),
        this.filesUpdated,
      ),
      h(
        "p",
        { class: "agent-updated" },
        h("span", { class: "sync-label", text: "Agent saves: " }),
        this.agentUpdated,
      ),
      h("p", {
        class: "help",
        text: "Direct changes are uploads, new folders, renames, moves, deletes, restores and purges made here or through the API. Agent saves are the checkpoints runs saved into this folder; each run is listed below.",
      }),
      h("h3", { text: "Agent runs" }),
      this.runList,
      this.error,
    );
  }

  startPolling() {
    clearInterval(this.timer);
    this.timer = setInterval(() => {
      if (!document.hidden) this.refresh();
    }, SYNC_POLL_MS);
  }

  stop() {
    clearInterval(this.timer);
  }

  showFilesUpdated(iso) {
    this.filesUpdated.replaceChildren(timeElement(iso, "none yet"));
  }

  /** The newest save of this folder by any run, with the run's agent. */
  showAgentUpdated(runs) {
    this.agentUpdated.classList.remove("muted");
    const saved = runs.filter((r) => r.folderSavedAt);
    if (!saved.length) {
      this.agentUpdated.replaceChildren(timeElement(null, "none yet"));
      return;
    }
    const newest = saved.reduce((a, b) => (a.folderSavedAt >= b.folderSavedAt ? a : b));
    this.agentUpdated.replaceChildren(
      timeElement(newest.folderSavedAt),
      ` by ${this.agentName(newest)}`,
    );
  }

  /** /sync names each run's agent (the agent outlives its runs). */
  agentName(run) {
    return run.agentName || "Unnamed agent";
  }

  async refresh() {
    const { folder } = this;
    if (folder.destroyed) return;
    try {
      const data = await folder.api.sync();
      if (folder.destroyed) return;
      this.error.textContent = "";
      this.render(data);
    } catch (err) {
      if (folder.destroyed) return;
      if (!(err instanceof ApiError)) throw err;
      this.error.textContent = `Could not load the sync state: ${folder.explain(err)}`;
    }
  }

  render(data) {
    this.showFilesUpdated(data.lastOperationAt);
    this.showAgentUpdated(data.runs);
    // A run whose state did not change keeps its element, so a poll never
    // takes keyboard focus or a pending message away from it.
    const previous = this.runItems || new Map();
    this.runItems = new Map();
    const items = data.runs.map((run) => {
      const key = JSON.stringify(run);
      const old = previous.get(run.runId);
      const note = old ? old.li.querySelector(".refresh-note").textContent : "";
      const li = old && old.key === key ? old.li : this.runItem(run, note);
      this.runItems.set(run.runId, { key, li });
      return li;
    });
    if (!items.length) {
      items.push(h("li", { class: "muted", text: "No agent runs have used this folder." }));
    }
    const unchanged =
      items.length === this.runList.children.length &&
      items.every((li, i) => this.runList.children[i] === li);
    if (unchanged) return;
    const focusedRun = document.activeElement?.closest?.(".runs li[data-run-id]");
    this.runList.replaceChildren(...items);
    if (focusedRun && !focusedRun.isConnected) {
      this.runItems.get(focusedRun.dataset.runId)?.li.querySelector("button")?.focus();
    }
  }

  runItem(run, note) {
    const agent = this.agentName(run);
    const state = runState(run);
    const pending = run.active && run.refreshRequested ? PENDING_REFRESH : "";
    const refreshNote = h("p", { class: "refresh-note", role: "status", text: note || pending });
    const refreshError = h("p", { class: "error", role: "alert" });
    const refresh =
      run.active && !this.folder.readOnly
        ? this.refreshButton(run, agent, refreshNote, refreshError)
        : null;
    return h(
      "li",
      { class: "run", dataset: { runId: run.runId, state: run.state } },
      h(
        "p",
        { class: "run-head" },
        h("strong", { text: agent }),
        h("span", { class: `state state-${state.key}`, text: state.text }),
        h("span", { class: "muted", text: run.active ? "running" : "ended" }),
      ),
      state.reason ? h("p", { class: "run-reason", text: state.reason }) : null,
      h(
        "p",
        { class: "run-saved" },
        "Last save of this folder: ",
        timeElement(run.folderSavedAt, "not yet"),
      ),
      run.lastSavedAt && run.lastSavedAt !== run.folderSavedAt
        ? h("p", { class: "muted small-text" }, "Last save of any of its folders: ", timeElement(run.lastSavedAt))
        : null,
      run.finalCheckpointAt ? h("p", {}, "Final save: ", timeElement(run.finalCheckpointAt)) : null,
      run.error && !state.reason
        ? h("p", { class: "error run-error", text: `Error: ${run.error}` })
        : null,
      // Warnings (a storage limit, a refused instruction entry) never block the
      // run and are not errors on the files now in the folder.
      run.warnings && run.warnings.length
        ? h(
            "ul",
            { class: "run-warnings", "aria-label": `Warnings for ${agent}` },
            run.warnings.map((w) => h("li", { text: `Warning: ${w.message}` })),
          )
        : null,
      h(
        "p",
        { class: "muted small-text" },
        "Started ",
        timeElement(run.startedAt, "—"),
        run.endedAt ? [", ended ", timeElement(run.endedAt)] : null,
      ),
      refresh,
      refreshNote,
      refreshError,
    );
  }

  refreshButton(run, agent, note, error) {
    // aria-disabled rather than disabled: a disabled button drops keyboard
    // focus to the top of the page right after it was pressed.
    const button = h("button", { type: "button", class: "small refresh" });
    const showRequested = (requested) => {
      const label = requested ? "Refresh requested" : "Request refresh";
      button.textContent = label;
      button.setAttribute("aria-label", `${label} for ${agent}`);
      button.setAttribute("aria-disabled", String(requested));
    };
    showRequested(run.refreshRequested);
    button.addEventListener("click", async () => {
      if (button.getAttribute("aria-disabled") === "true") return;
      button.setAttribute("aria-disabled", "true");
      error.textContent = "";
      try {
        await this.folder.api.requestRefresh(run.runId);
        showRequested(true);
        note.textContent = PENDING_REFRESH;
      } catch (err) {
        showRequested(false);
        error.textContent = `Could not request a refresh: ${this.folder.explain(err)}`;
      }
    });
    return button;
  }
}
