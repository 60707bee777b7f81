// The home view: per company, "My files" and one search box over its tasks,
// agents and projects. Each result links to its folder and says whether the
// folder has files and whether an agent run is active there; the company
// directory carries both (fetched afresh each time home is shown), so no
// request is made per folder.

import { ApiError } from "./api.js";
import { clear, h, uid } from "./dom.js";

const MAX_RESULTS = 30;
const KINDS = [
  { scope: "task", label: "Task", list: (d) => d.tasks, name: (t) => t.title },
  { scope: "agent", label: "Agent", list: (d) => d.agents, name: (a) => a.name },
  { scope: "project", label: "Project", list: (d) => d.projects, name: (p) => p.name },
];

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
    fillSearch(body, company.id, () => directoryFor(company.id, { fresh: true }));
  }
  heading.focus();
}

async function fillSearch(container, companyId, loadDirectory) {
  let directory;
  try {
    directory = await loadDirectory();
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
    kind.list(directory).map((item) => ({
      kind,
      id: item.id,
      name: kind.name(item),
      hasFiles: item.hasFiles,
      activeRun: item.activeRun,
    })),
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
  return h(
    "li",
    { class: "result", dataset: { scope: item.kind.scope, id: item.id } },
    h("a", {
      href: `/files/${encodeURIComponent(companyId)}/${item.kind.scope}/${encodeURIComponent(item.id)}`,
      "data-nav": true,
      text: `${item.kind.label}: ${item.name}`,
    }),
    h(
      "span",
      { class: "result-status" },
      // null: an agent's folder the person may not open (no configure permission).
      h("span", {
        class: `badge ${item.hasFiles ? "badge-files" : ""}`,
        text: item.hasFiles === null ? "No access" : item.hasFiles ? "Has files" : "No files yet",
      }),
      item.activeRun ? h("span", { class: "badge badge-active", text: "Agent running" }) : null,
    ),
  );
}
