// The sync panel: when the folder's files last changed directly, and each
// agent run that used the folder with its save state and a "Request refresh"
// button. Polled every SYNC_POLL_MS while the tab is visible.

import { ApiError } from "./api.js";
import { h, timeElement } from "./dom.js";

const SYNC_POLL_MS = 15000;
const RUN_STATE_LABEL = {
  starting: "Starting",
  saving: "Saving",
  saved: "Saved",
  failed: "Save failed",
};

export class SyncPanel {
  constructor(folder, ids) {
    this.folder = folder;
    this.agentNames = new Map();
    this.last = null; // the last /sync answer, re-rendered when names arrive
    this.runItems = null; // runId -> {key, li}
    this.timer = null;
    this.section = this.build(ids);
  }

  build(ids) {
    this.filesUpdated = h("span", { class: "files-updated-value" });
    this.runList = h("ul", { class: "runs" });
    this.error = h("p", { class: "error", role: "alert" });
    return h(
      "section",
      { class: "card sync", "aria-labelledby": ids.sync },
      h("h2", { id: ids.sync, text: "Sync" }),
      h("p", { class: "files-updated" }, "Files updated: ", this.filesUpdated),
      h("p", {
        class: "help",
        text: "Files updated is the last direct change here (upload, new folder, delete, restore or purge). Agent saves are listed per run below.",
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

  /** Names for agent ids from the company directory; shown from the next render. */
  addAgentNames(agents) {
    for (const agent of agents) this.agentNames.set(agent.id, agent.name);
  }

  rerender() {
    if (this.last) this.render(this.last);
  }

  showFilesUpdated(iso) {
    this.filesUpdated.replaceChildren(timeElement(iso, "no changes yet"));
  }

  async refresh() {
    const { folder } = this;
    if (folder.destroyed) return;
    try {
      const data = await folder.api.sync();
      if (folder.destroyed) return;
      this.error.textContent = "";
      this.last = data;
      this.render(data);
    } catch (err) {
      if (folder.destroyed) return;
      if (!(err instanceof ApiError)) throw err;
      this.error.textContent = `Could not load the sync state: ${folder.explain(err)}`;
    }
  }

  render(data) {
    this.showFilesUpdated(data.lastOperationAt);
    // A run whose state did not change keeps its element, so a poll never
    // takes keyboard focus or a pending message away from it.
    const previous = this.runItems || new Map();
    this.runItems = new Map();
    const items = data.runs.map((run) => {
      const key = JSON.stringify(run) + (this.agentNames.get(run.agentId) || "");
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
    const agent = this.agentNames.get(run.agentId) || `Agent ${run.agentId.slice(0, 8)}`;
    const stateLabel = RUN_STATE_LABEL[run.state] || run.state;
    const refreshNote = h("p", { class: "refresh-note", role: "status", text: note });
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
        h("span", { class: `state state-${run.state}`, text: stateLabel }),
        h("span", { class: "muted", text: run.active ? "running" : "ended" }),
      ),
      h("p", {}, "Last agent save: ", timeElement(run.lastSavedAt, "not yet")),
      run.finalCheckpointAt ? h("p", {}, "Final save: ", timeElement(run.finalCheckpointAt)) : null,
      run.error ? h("p", { class: "error run-error", text: `Error: ${run.error}` }) : null,
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
        note.textContent = "Refresh requested: the agent picks up changes at its next safe point.";
      } catch (err) {
        showRequested(false);
        error.textContent = `Could not request a refresh: ${this.folder.explain(err)}`;
      }
    });
    return button;
  }
}
