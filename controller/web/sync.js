// The sync panel: when the folder's files were last updated directly
// ("Files updated") and, apart from that, its last agent save, and each
// agent run bound to the folder with its save state of this folder in words,
// whether it is running, stopped (its sandbox's final save of this folder
// came, before the orchestrator ends the run) or ended, its own last save of
// this folder, and a "Request refresh" button. Polled every SYNC_POLL_MS while the tab is
// visible, and at once when live.js sees the folder change.

import { ApiError } from "./api.js";
import { h, timeElement } from "./dom.js";

const SYNC_POLL_MS = 15000;
/** A refusal over an agent folder's storage limit: a warning, the run goes on. */
const LIMIT_CODE = "AGENT_FILES_LIMIT_EXCEEDED";
/** What a run's saves meet once a newer run of its sandbox took over. */
const SUPERSEDED_CODE = "STALE_LEASE";

const PENDING_REFRESH =
  "Refresh requested: waiting for the agent. It takes this folder's new files at its next safe point, and the request clears once it has.";

/**
 * {key, text, reason, error}: the run's save state of this folder in words,
 * from /sync's folderState, folderCode and folderError. Each folder shows its
 * own state, never another folder's failure, and a failed save stays shown
 * until a later save of this folder succeeds. A run that saved other folders
 * but never this one does not read "Saved" here, and an ended run that never
 * saved this folder says why.
 */
function runState(run) {
  const code = run.folderCode;
  if (run.folderState === "saved") {
    return { key: "saved", text: run.active ? "Saved" : "Ended — saved" };
  }
  if (run.folderState === "saving") return { key: "saving", text: "Saving" };
  if (run.folderState === "starting") {
    return run.lastSavedAt
      ? { key: "starting", text: "Running — not saved here yet" }
      : { key: "starting", text: "Starting" };
  }
  if (code === LIMIT_CODE) {
    return {
      key: "refused",
      text: run.active ? "Not saved — over a storage limit" : "Ended — not saved (storage limit)",
      reason: `The last save of this folder was refused (${code}); none of its changes were saved. The warnings say which limit; the run goes on.`,
    };
  }
  if (code === SUPERSEDED_CODE && run.superseded) {
    return {
      key: "failed",
      text: "Ended — superseded",
      reason: `A newer run of the same sandbox took over (${code}): this run's saves of this folder are refused.`,
    };
  }
  if (!run.active && !code && !run.folderError) {
    const reason = run.lastSavedAt
      ? "The run saved its other folders, never this one."
      : "The run ended before it saved anything.";
    return { key: "failed", text: "Ended — not saved", reason };
  }
  const message = run.folderError || "the save failed";
  return {
    key: "failed",
    text: run.active ? "Save failed" : "Ended — save failed",
    error: code ? `${code}: ${message}` : message,
  };
}

/**
 * [words...]: running, stopped (the sandbox's final save of this folder came,
 * /sync's folderStoppedAt; the orchestrator has not ended the run yet) or ended.
 */
function runActivity(run) {
  if (!run.active) return ["ended"];
  if (!run.folderStoppedAt) return ["running"];
  if (run.folderState === "saved") return ["stopped, saved at ", timeElement(run.folderStoppedAt)];
  return ["stopped, not saved"];
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
    // A line held from the start: on one column the panel sits above the
    // listing, and a list that grew when /sync answered would move the rows.
    this.runList = h("ul", { class: "runs" }, h("li", { class: "muted", text: "loading…" }));
    this.error = h("p", { class: "error", role: "alert" });
    return h(
      "section",
      { class: "card sync", "aria-labelledby": ids.sync },
      h("h2", { id: ids.sync, text: "Sync" }),
      // First in the panel, so no run list pushes it out of sight.
      this.error,
      h(
        "p",
        { class: "files-updated" },
        h("span", { class: "sync-label", text: "Files updated: " }),
        this.filesUpdated,
      ),
      h(
        "p",
        { class: "agent-updated" },
        h("span", { class: "sync-label", text: "Last agent save: " }),
        this.agentUpdated,
      ),
      h("p", {
        class: "help",
        text: "Files updated: the last upload, new folder, rename, move, delete, restore or purge made here or through the API. Last agent save: the newest checkpoint a run saved into this folder; each run is listed below.",
      }),
      h("h3", { text: "Agent runs" }),
      this.runList,
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
    // A stopped run's sandbox takes no refresh until it runs again.
    const refresh =
      run.active && !run.folderStoppedAt && !this.folder.readOnly
        ? this.refreshButton(run, agent, refreshNote, refreshError)
        : null;
    return h(
      "li",
      { class: "run", dataset: { runId: run.runId, state: run.folderState } },
      h(
        "p",
        { class: "run-head" },
        h("strong", { text: agent }),
        h("span", { class: `state state-${state.key}`, text: state.text }),
        h("span", { class: "muted run-activity" }, ...runActivity(run)),
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
      state.error ? h("p", { class: "error run-error", text: `Error: ${state.error}` }) : null,
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
