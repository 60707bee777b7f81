// A modal confirmation built on <dialog>: focus moves into it, Escape
// cancels, and focus returns to the control that opened it.

import { h } from "./dom.js";

/**
 * Ask before a destructive action. Resolves true when confirmed.
 * `danger` styles the confirm button as destructive.
 */
export function confirmAction({ title, message, confirmLabel, danger = true }) {
  const opener = document.activeElement;
  return new Promise((resolve) => {
    const cancel = h("button", { type: "button", class: "secondary", value: "cancel" }, "Cancel");
    const confirm = h(
      "button",
      { type: "button", class: danger ? "danger" : "", value: "confirm" },
      confirmLabel,
    );
    const dialog = h(
      "dialog",
      {
        class: "confirm",
        "aria-labelledby": "confirm-title",
        "aria-describedby": "confirm-message",
      },
      h("h2", { id: "confirm-title", text: title }),
      h("p", { id: "confirm-message", text: message }),
      h("div", { class: "dialog-actions" }, cancel, confirm),
    );
    let answered = false;
    const finish = (answer) => {
      if (answered) return;
      answered = true;
      if (dialog.open) dialog.close();
      dialog.remove();
      if (opener && opener.isConnected && typeof opener.focus === "function") opener.focus();
      resolve(answer);
    };
    cancel.addEventListener("click", () => finish(false));
    confirm.addEventListener("click", () => finish(true));
    dialog.addEventListener("close", () => finish(false));
    document.body.append(dialog);
    dialog.showModal();
    cancel.focus();
  });
}
