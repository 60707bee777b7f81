// Entry point of the Files page: session, routing, sign-in and the home view.
//
// Routes (all under /files/):
//   /files/                                  home: "My files" and a search per company
//   /files/{companyId}/{scope}/{ownerId}     one work folder (?dir=a/b, ?view=trash,
//                                            ?preview=a/b/c.txt, ?edit=a/b/c.txt,
//                                            ?q=filter, ?page=N)

import {
  ApiError,
  companyDirectory,
  getSession,
  setCsrfToken,
  setUnauthenticatedHandler,
  signIn,
  signOut,
} from "./api.js";
import { carriesFiles, clear, h, uid } from "./dom.js";
import { FolderPage, SCOPES } from "./folder.js";
import { renderHome } from "./home.js";

const main = document.getElementById("main");
const account = document.getElementById("account");

const app = {
  session: null,
  page: null, // the FolderPage while one is shown
  directories: new Map(), // companyId -> Promise of /directory
};

/** The company directory, fetched once per company per page load (`fresh`: again). */
export function directoryFor(companyId, { fresh = false } = {}) {
  if (fresh || !app.directories.has(companyId)) {
    const pending = companyDirectory(companyId).catch((err) => {
      app.directories.delete(companyId);
      throw err;
    });
    app.directories.set(companyId, pending);
  }
  return app.directories.get(companyId);
}

function parseRoute() {
  const rest = location.pathname.replace(/^\/files\/?/, "");
  const parts = rest.split("/").filter(Boolean);
  const params = new URLSearchParams(location.search);
  if (parts.length === 0) return { name: "home" };
  if (parts.length === 3) {
    let decoded;
    try {
      decoded = parts.map(decodeURIComponent);
    } catch {
      return { name: "unknown" };
    }
    const [companyId, scope, ownerId] = decoded;
    return {
      name: "folder",
      companyId,
      scope,
      ownerId,
      dir: params.get("dir") || "",
      view: params.get("view") === "trash" ? "trash" : "files",
      preview: params.get("preview") || null,
      edit: params.get("edit") || null,
      q: params.get("q") || "",
      page: Math.max(1, Number.parseInt(params.get("page") || "1", 10) || 1),
    };
  }
  return { name: "unknown" };
}

/** Go to a page URL without reloading; the folder page keeps its uploads. */
export function navigate(url, { replace = false } = {}) {
  if (replace) history.replaceState(null, "", url);
  else history.pushState(null, "", url);
  render();
}

// Same-origin links marked data-nav are handled here so that in-page state
// (uploads in progress, loaded pages) survives moving between directories.
document.addEventListener("click", (event) => {
  const link = event.target.closest("a[data-nav]");
  if (!link || event.defaultPrevented || event.button !== 0) return;
  if (event.metaKey || event.ctrlKey || event.shiftKey || event.altKey) return;
  event.preventDefault();
  navigate(link.getAttribute("href"));
});

window.addEventListener("popstate", () => render());

// Dropping a file anywhere outside the drop zone must not navigate away.
for (const type of ["dragover", "drop"]) {
  window.addEventListener(type, (event) => {
    if (carriesFiles(event)) {
      event.preventDefault();
    }
  });
}

setUnauthenticatedHandler(() => {
  if (!app.session) return;
  app.session = null;
  setCsrfToken("");
  showSignIn("Your session ended. Sign in again to continue.");
});

function renderAccount() {
  clear(account);
  if (!app.session) return;
  account.append(
    h("span", { class: "who" }, "Signed in as ", h("strong", { text: app.session.email || "" })),
    h("button", { type: "button", class: "secondary", onClick: onSignOut }, "Sign out"),
  );
}

async function onSignOut(event) {
  const button = event.currentTarget;
  button.disabled = true;
  try {
    await signOut();
  } catch (err) {
    if (!(err instanceof ApiError)) throw err;
    // 401: the session had already ended, which is what was asked for.
    // Anything else leaves the cookie in place, so say so and stay.
    if (err.status !== 401) {
      button.disabled = false;
      account.querySelector(".error")?.remove();
      account.append(
        h("p", { class: "error", role: "alert", text: `Could not sign out: ${err.message}` }),
      );
      return;
    }
  }
  app.session = null;
  setCsrfToken("");
  app.directories.clear();
  showSignIn("You have signed out.");
}

function teardownPage() {
  if (app.page) {
    app.page.destroy();
    app.page = null;
  }
}

function showSignIn(notice = "") {
  teardownPage();
  renderAccount();
  document.title = "Sign in · Files";
  const inputId = uid("token");
  const error = h("p", { class: "error", role: "alert" });
  const input = h("input", {
    id: inputId,
    name: "token",
    type: "password",
    autocomplete: "off",
    spellcheck: "false",
    required: true,
    "aria-describedby": `${inputId}-help`,
  });
  const submit = h("button", { type: "submit" }, "Sign in");
  const form = h(
    "form",
    { class: "signin card", "aria-labelledby": "signin-title" },
    h("h1", { id: "signin-title", text: "Sign in to Files" }),
    notice ? h("p", { class: "notice", role: "status", text: notice }) : null,
    h("label", { for: inputId, text: "API token" }),
    input,
    h("p", {
      id: `${inputId}-help`,
      class: "help",
      text: "Paste your personal API token. It is exchanged for a session cookie and not stored by the page.",
    }),
    submit,
    error,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    submit.disabled = true;
    try {
      const session = await signIn(input.value.trim());
      input.value = "";
      startSession(session);
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      error.textContent =
        err.status === 401 ? "That token was not accepted. Check it and try again." : err.message;
      submit.disabled = false;
      input.focus();
    }
  });
  clear(main).append(form);
  input.focus();
}

function startSession(session) {
  app.session = session;
  setCsrfToken(session.csrfToken);
  app.directories.clear();
  renderAccount();
  render();
}

function render() {
  if (!app.session) return;
  const route = parseRoute();
  if (route.name === "folder") {
    if (app.page && app.page.sameFolder(route)) {
      app.page.show(route);
      return;
    }
    teardownPage();
    app.page = new FolderPage(main, route, {
      session: app.session,
      navigate,
      directoryFor,
      validScope: SCOPES.includes(route.scope),
    });
    app.page.start();
    return;
  }
  teardownPage();
  if (route.name === "home") renderHome(main, app.session, directoryFor);
  else renderUnknown();
}

function renderUnknown() {
  document.title = "Not found · Files";
  const heading = h("h1", { tabindex: "-1", text: "Page not found" });
  clear(main).append(
    heading,
    h(
      "p",
      {},
      "There is no page at this address. ",
      h("a", { href: "/files/", "data-nav": true }, "Go to your files"),
      ".",
    ),
  );
  heading.focus();
}

async function boot() {
  try {
    startSession(await getSession());
  } catch (err) {
    if (!(err instanceof ApiError)) throw err;
    if (err.status === 401) showSignIn();
    else {
      clear(main).append(
        h("h1", { text: "Files" }),
        h("p", {
          class: "error",
          role: "alert",
          text: `Could not check your session: ${err.message}`,
        }),
      );
    }
  }
}

boot();
