// The task view's repositories: each checkout the task's runs keep in
// $HOME/repos, with its last save, size, file count, save state and error,
// and a link that downloads the saved checkpoint as a tar. Only a task
// folder has this panel. Polled with the sync panel's period while the tab
// is visible, and whenever the page refreshes its sync state.

import { ApiError, repoArchiveUrl, taskRepos } from "./api.js";
import { formatSize, h, timeElement } from "./dom.js";

const POLL_MS = 15000;
const STATE = {
  unsaved: { key: "starting", text: "Not saved yet" },
  saving: { key: "saving", text: "Saving" },
  saved: { key: "saved", text: "Saved" },
  failed: { key: "failed", text: "Save failed" },
};

export class RepoPanel {
  constructor(folder, headingId) {
    this.folder = folder;
    this.timer = null;
    this.shown = ""; // the last answer rendered, so an unchanged poll keeps focus
    // A line held from the start, as in the sync panel: above the listing
    // on one column, a list that grew on the first answer would move the rows.
    this.list = h("ul", { class: "repos" }, h("li", { class: "muted", text: "loading…" }));
    this.error = h("p", { class: "error", role: "alert" });
    this.section = h(
      "section",
      { class: "card repos-card", "aria-labelledby": headingId },
      h("h2", { id: headingId, text: "Repositories" }),
      h("p", {
        class: "help",
        text: "The task's own checkouts of its project's repositories. Agents save them with the folder; a download is the last saved checkpoint.",
      }),
      this.list,
      this.error,
    );
  }

  startPolling() {
    clearInterval(this.timer);
    this.timer = setInterval(() => {
      if (!document.hidden) this.refresh();
    }, POLL_MS);
  }

  stop() {
    clearInterval(this.timer);
  }

  async refresh() {
    const { folder } = this;
    if (folder.destroyed) return;
    const { companyId, ownerId } = folder.route;
    try {
      const data = await taskRepos(companyId, ownerId);
      if (folder.destroyed) return;
      this.error.textContent = "";
      this.render(data.repos);
    } catch (err) {
      if (folder.destroyed) return;
      if (!(err instanceof ApiError)) throw err;
      this.error.textContent = `Could not load the repositories: ${folder.explain(err)}`;
    }
  }

  render(repos) {
    const key = JSON.stringify(repos);
    if (key === this.shown) return;
    this.shown = key;
    if (!repos.length) {
      this.list.replaceChildren(
        h("li", { class: "muted", text: "This task has no repositories yet." }),
      );
      return;
    }
    this.list.replaceChildren(...repos.map((repo) => this.item(repo)));
  }

  item(repo) {
    const state = STATE[repo.state] || { key: repo.state, text: repo.state };
    const { companyId, ownerId } = this.folder.route;
    const saved = Boolean(repo.checkpointId);
    const files = repo.fileCount === 1 ? "1 file" : `${repo.fileCount} files`;
    return h(
      "li",
      { class: "repo", dataset: { workspaceId: repo.workspaceId, state: repo.state } },
      h(
        "p",
        { class: "repo-head" },
        h("strong", { class: "repo-name", text: repo.name }),
        h("span", { class: `state state-${state.key}`, text: state.text }),
      ),
      h("p", { class: "muted small-text repo-url", text: repo.repoUrl }),
      h("p", { class: "repo-saved" }, "Last save: ", timeElement(repo.lastSavedAt, "not yet")),
      saved
        ? h("p", { class: "repo-size", text: `${formatSize(repo.byteSize)} in ${files}` })
        : null,
      repo.error ? h("p", { class: "error repo-error", text: `Error: ${repo.error}` }) : null,
      repo.removed
        ? h("p", {
            class: "muted small-text",
            text: "Removed from the project; its last save is kept.",
          })
        : null,
      saved
        ? h(
            "p",
            {},
            h(
              "a",
              {
                class: "repo-download",
                href: repoArchiveUrl(companyId, ownerId, repo.workspaceId),
                download: `${repo.name}.tar`,
                "aria-label": `Download ${repo.name} as a tar archive`,
              },
              "Download .tar",
            ),
          )
        : null,
    );
  }
}
