// The "New folder" form of the files view: creates a directory (or a path of
// them) below the current directory.

import { h, joinPath } from "./dom.js";

export class NewFolderForm {
  constructor(folder, ids) {
    this.folder = folder;
    this.input = h("input", {
      id: ids.folderName,
      name: "folder-name",
      type: "text",
      autocomplete: "off",
      spellcheck: "false",
    });
    this.error = h("p", { class: "error", role: "alert" });
    const button = h("button", { type: "submit" }, "Create folder");
    this.form = h(
      "form",
      { class: "new-folder" },
      h("label", { for: ids.folderName, text: "New folder" }),
      this.input,
      button,
    );
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.create(button);
    });
  }

  async create(button) {
    const { folder } = this;
    const name = this.input.value.trim().replace(/^\/+|\/+$/g, "");
    this.error.textContent = "";
    if (!name) {
      this.error.textContent = "Enter a name for the new folder.";
      this.input.focus();
      return;
    }
    const path = joinPath(folder.dir, name);
    button.disabled = true;
    try {
      const result = await folder.api.operation({ action: "mkdir", path });
      this.input.value = "";
      // A nested path may have created directories above the new entry too.
      if (name.includes("/")) folder.listing.reload();
      else folder.listing.upsertEntries(result.files || []);
      folder.announce(
        result.applied ? `Created folder ${name}.` : `Folder ${name} already exists.`,
      );
      folder.refreshSync();
    } catch (err) {
      this.error.textContent = `Could not create folder ${name}: ${folder.explain(err)}`;
    } finally {
      button.disabled = false;
    }
  }
}
