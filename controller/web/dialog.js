// Modal dialogs built on <dialog>: focus moves into them, Escape cancels,
// and focus returns to the control that opened them (or to `returnFocus`).

import { h, uid } from "./dom.js";

/**
 * Show a modal with `body` and one button per choice; resolves with the
 * chosen value, or null when cancelled (Cancel or Escape). A choice with
 * `submit` submits the dialog's form, so Enter in a text field picks it.
 */
function openDialog({ title, message, body = null, choices, initialFocus = null }) {
  const opener = document.activeElement;
  const titleId = uid("dialog-title");
  const messageId = uid("dialog-message");
  return new Promise((resolve) => {
    const cancel = h("button", { type: "button", class: "secondary" }, "Cancel");
    const buttons = choices.map((c) =>
      h("button", { type: c.submit ? "submit" : "button", class: c.class || "" }, c.label),
    );
    const form = h(
      "form",
      { method: "dialog" },
      h("h2", { id: titleId, text: title }),
      message ? h("p", { id: messageId, text: message }) : null,
      body,
      h("div", { class: "dialog-actions" }, cancel, ...buttons),
    );
    const dialog = h(
      "dialog",
      {
        class: "confirm",
        "aria-labelledby": titleId,
        "aria-describedby": message ? messageId : null,
      },
      form,
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
    cancel.addEventListener("click", () => finish(null));
    buttons.forEach((button, i) => {
      const choice = choices[i];
      if (!choice.submit) button.addEventListener("click", () => finish(choice.value));
    });
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const choice = choices.find((c) => c.submit);
      if (choice && (!choice.accept || choice.accept())) finish(choice.value);
    });
    dialog.addEventListener("close", () => finish(null));
    document.body.append(dialog);
    dialog.showModal();
    (initialFocus || cancel).focus();
  });
}

/**
 * Ask before a destructive action. Resolves true when confirmed.
 * `danger` styles the confirm button as destructive.
 */
export async function confirmAction({ title, message, confirmLabel, danger = true }) {
  const answer = await openDialog({
    title,
    message,
    choices: [{ label: confirmLabel, value: true, class: danger ? "danger" : "" }],
  });
  return answer === true;
}

/** Pick one of `choices` ({label, value, class}); null when cancelled. */
export function chooseAction({ title, message, choices }) {
  return openDialog({ title, message, choices });
}

/**
 * Ask for a line of text (a new name, a destination). `check(text)` returns
 * an error message or "" for a good answer; resolves with the trimmed text or null.
 */
export function askText({ title, message, label, value = "", confirmLabel, check = () => "" }) {
  const inputId = uid("dialog-input");
  const input = h("input", {
    id: inputId,
    type: "text",
    autocomplete: "off",
    spellcheck: "false",
    value,
  });
  const error = h("p", { class: "error", role: "alert" });
  const body = h("div", { class: "dialog-field" }, h("label", { for: inputId, text: label }), input, error);
  const answer = openDialog({
    title,
    message,
    body,
    initialFocus: input,
    choices: [
      {
        label: confirmLabel,
        value: "ok",
        submit: true,
        accept: () => {
          error.textContent = check(input.value.trim());
          if (error.textContent) input.focus();
          return !error.textContent;
        },
      },
    ],
  });
  // Select the name without its extension, as file managers do.
  const dot = value.lastIndexOf(".");
  input.setSelectionRange(0, dot > 0 ? dot : value.length);
  return answer.then((a) => (a === "ok" ? input.value.trim() : null));
}
