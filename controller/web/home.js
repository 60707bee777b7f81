// The home view: per company, "My files" and one search box over its tasks,
// agents and projects. Each result links to its folder and says whether the
// folder has files and whether an agent run is active there (looked up for
// the results shown, at most MAX_RESULTS, and remembered for the page's life).

import { ApiError, FolderApi } from "./api.js";
import { clear, h, uid } from "./dom.js";

const MAX_RESULTS = 30;
const KINDS = [
  { scope: "task", label: "Task", list: (d) => d.tasks, name: (t) => t.title },
  { scope: "agent", label: "Agent", list: (d) => d.agents, name: (a) => a.name },
  { scope: "project", label: "Project", list: (d) => d.projects, name: (p) => p.name },
];

const STATUS_CONCURRENCY = 4; // well under the server's requests-in-flight limit per session
const statusCache = new Map(); // "company/scope/id" -> Promise of {hasFiles, active}
const waiting = []; // lookups not started yet
let running = 0;

/** Run `task` (returns a promise) when fewer than STATUS_CONCURRENCY are running. */
function queued(task) {
  return new Promise((resolve, reject) => {
    waiting.push({ task, resolve, reject });
    pump();
  });
}

function pump() {
  while (running < STATUS_CONCURRENCY && waiting.length) {
    const { task, resolve, reject } = waiting.shift();
    running += 1;
    task()
      .then(resolve, reject)
      .finally(() => {
        running -= 1;
        pump();
      });
  }
}

function folderStatus(companyId, scope, id) {
  const key = `${companyId}/${scope}/${id}`;
  if (!statusCache.has(key)) {
    const api = new FolderApi(companyId, scope, id);
    const lookup = () => Promise.all([api.list({ limit: 1 }), api.sync()]);
    const pending = queued(lookup).then(
      ([page, sync]) => ({ hasFiles: page.total > 0, active: sync.runs.some((r) => r.active) }),
      (err) => {
        statusCache.delete(key);
        throw err;
      },
    );
    statusCache.set(key, pending);
  }
  return statusCache.get(key);
}

export function renderHome(main, session, directoryFor) {
  document.title = "Files";
  const heading = h("h1", { tabindex: "-1", text: "Files" });
  clear(main).append(heading);
  if (!session.companies.length) {
    main.append(h("p", { text: "You are not a member of any company yet." }));
    heading.focus();
    return;
  }
  for (const company of session.companies) {
    const headingId = uid("company");
    const body = h(
      "div",
      { class: "home-search", "aria-busy": "true" },
      h("p", { class: "muted", text: "Loading tasks, agents and projects…" }),
    );
    main.append(
      h(
        "section",
        { class: "card company", "aria-labelledby": headingId },
        h("h2", { id: headingId, text: company.name }),
        h("p", { class: "muted", text: `Your role: ${company.role}` }),
        h(
          "p",
          {},
          h("a", {
            class: "button-link",
            href: `/files/${encodeURIComponent(company.id)}/user/${encodeURIComponent(session.userId)}`,
            "data-nav": true,
            text: "My files",
          }),
        ),
        body,
      ),
    );
    fillSearch(body, company.id, directoryFor);
  }
  heading.focus();
}

async function fillSearch(container, companyId, directoryFor) {
  let directory;
  try {
    directory = await directoryFor(companyId);
  } catch (err) {
    if (!(err instanceof ApiError)) throw err;
    container.removeAttribute("aria-busy");
    clear(container).append(
      h("p", {
        class: "error",
        role: "alert",
        text: `Could not load this company's folders: ${err.message}`,
      }),
    );
    return;
  }
  container.removeAttribute("aria-busy");
  const items = KINDS.flatMap((kind) =>
    kind.list(directory).map((item) => ({ kind, id: item.id, name: kind.name(item) })),
  );
  const inputId = uid("search");
  const input = h("input", { id: inputId, type: "search", autocomplete: "off" });
  const summary = h("p", { class: "muted", "aria-live": "polite" });
  const results = h("ul", { class: "results" });
  const show = () => {
    const q = input.value.trim().toLowerCase();
    const found = items.filter((i) => !q || i.name.toLowerCase().includes(q));
    const shown = found.slice(0, MAX_RESULTS);
    results.replaceChildren(...shown.map((item) => resultItem(companyId, item)));
    summary.textContent = !items.length
      ? "No tasks, agents or projects yet."
      : found.length > shown.length
        ? `Showing ${shown.length} of ${found.length} matches; type more to narrow them down.`
        : `${found.length} ${found.length === 1 ? "match" : "matches"}.`;
  };
  input.addEventListener("input", show);
  clear(container).append(
    h("label", { for: inputId, text: "Search tasks, agents and projects" }),
    input,
    summary,
    results,
  );
  show();
}

function resultItem(companyId, item) {
  const status = h("span", { class: "result-status muted", text: "…" });
  const li = h(
    "li",
    { class: "result", dataset: { scope: item.kind.scope, id: item.id } },
    h("a", {
      href: `/files/${encodeURIComponent(companyId)}/${item.kind.scope}/${encodeURIComponent(item.id)}`,
      "data-nav": true,
      text: `${item.kind.label}: ${item.name}`,
    }),
    status,
  );
  folderStatus(companyId, item.kind.scope, item.id).then(
    ({ hasFiles, active }) => {
      status.replaceChildren(
        h("span", { class: `badge ${hasFiles ? "badge-files" : ""}`, text: hasFiles ? "Has files" : "No files yet" }),
        active ? h("span", { class: "badge badge-active", text: "Agent running" }) : null,
      );
    },
    (err) => {
      if (!(err instanceof ApiError)) throw err;
      // An agent's folder needs its configure permission: the directory lists
      // the agent anyway, so saying so reveals nothing the page did not show.
      status.textContent = err.code === "not_found" ? "no access" : "status unavailable";
    },
  );
  return li;
}
