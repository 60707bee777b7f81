// A menu button: one "Actions for NAME" button per row opens a list of
// actions (role="menu"). Arrow keys move between the items, Escape and a
// click elsewhere close it, and focus goes back to the button.

import { h } from "./dom.js";

let openMenu = null; // the one menu open at a time

document.addEventListener("pointerdown", (event) => {
  if (openMenu && !openMenu.wrap.contains(event.target)) openMenu.close(false);
});

/**
 * `items`: [{label, onSelect, danger, href, download}]; an item with `href`
 * is a link (downloads), the others are buttons.
 */
export class MenuButton {
  constructor(label, items) {
    this.button = h(
      "button",
      {
        type: "button",
        class: "small menu-button",
        "aria-haspopup": "menu",
        "aria-expanded": "false",
        "aria-label": label,
      },
      h("span", { "aria-hidden": "true", text: "⋯" }),
    );
    this.items = items;
    this.menu = null;
    this.wrap = h("div", { class: "menu-wrap" }, this.button);
    this.button.addEventListener("click", () => (this.menu ? this.close(true) : this.open()));
    this.button.addEventListener("keydown", (event) => {
      if (event.key === "ArrowDown" || event.key === "ArrowUp") {
        event.preventDefault();
        this.open(event.key === "ArrowUp" ? -1 : 0);
      }
    });
  }

  open(focusIndex = 0) {
    if (openMenu && openMenu !== this) openMenu.close(false);
    const entries = this.items.map((item) => {
      const attrs = { role: "menuitem", tabindex: "-1", class: item.danger ? "danger-text" : "" };
      const el = item.href
        ? h("a", { ...attrs, href: item.href, download: item.download || true }, item.label)
        : h("button", { ...attrs, type: "button" }, item.label);
      el.addEventListener("click", () => {
        this.close(!item.keepsFocus);
        if (item.onSelect) item.onSelect();
      });
      return el;
    });
    this.menu = h("div", { role: "menu", class: "menu" }, entries);
    this.menu.addEventListener("keydown", (event) => this.onKey(event, entries));
    this.wrap.append(this.menu);
    this.button.setAttribute("aria-expanded", "true");
    openMenu = this;
    entries.at(focusIndex)?.focus();
  }

  onKey(event, entries) {
    const i = entries.indexOf(document.activeElement);
    const go = (j) => entries[(j + entries.length) % entries.length].focus();
    if (event.key === "ArrowDown") go(i + 1);
    else if (event.key === "ArrowUp") go(i - 1);
    else if (event.key === "Home") go(0);
    else if (event.key === "End") go(entries.length - 1);
    else if (event.key === "Escape") this.close(true);
    else {
      if (event.key === "Tab") this.close(false);
      return;
    }
    event.preventDefault();
    event.stopPropagation();
  }

  close(refocus) {
    if (!this.menu) return;
    this.menu.remove();
    this.menu = null;
    this.button.setAttribute("aria-expanded", "false");
    if (openMenu === this) openMenu = null;
    if (refocus) this.button.focus();
  }
}
