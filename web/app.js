// Tessera dashboard script. The pages work as plain HTML; this adds three things:
//  - live regions: any element with data-live="<url>" re-fetches that fragment every
//    few seconds and swaps it in (logs marked data-follow stay scrolled to the end);
//  - confirmation for forms marked data-confirm="<question>";
//  - the model upload form (folder picking, drag and drop, progress).
"use strict";

(function () {
  const POLL_MS = 3000;

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let value = n;
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return unit === 0 ? `${n} B` : `${value.toFixed(1)} ${units[unit]}`;
  }

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // ---- Live regions -------------------------------------------------------------

  // What a swap must not undo: where a followed log is scrolled, which sections are open.
  function followState(container) {
    const saved = new Map();
    container.querySelectorAll("[data-follow][id]").forEach((node) => {
      const atEnd = node.scrollHeight - node.scrollTop - node.clientHeight < 8;
      saved.set(node.id, { atEnd, top: node.scrollTop });
    });
    container.querySelectorAll("details[id]").forEach((node) => saved.set(node.id, { open: node.open }));
    return saved;
  }

  function restoreFollow(container, saved) {
    container.querySelectorAll("[data-follow]").forEach((node) => {
      const state = saved.get(node.id);
      node.scrollTop = !state || state.atEnd ? node.scrollHeight : state.top;
    });
    container.querySelectorAll("details[id]").forEach((node) => {
      const state = saved.get(node.id);
      if (state) node.open = state.open;
    });
  }

  function setStale(stale) {
    document.querySelectorAll(".live-dot").forEach((dot) => dot.classList.toggle("stale", stale));
  }

  function startLive(container) {
    const url = container.dataset.live;
    let last = container.innerHTML;
    let timer = null;
    let busy = false;

    async function refresh() {
      if (busy) return;
      busy = true;
      try {
        const response = await fetch(url, {
          headers: { "X-Requested-With": "fetch" },
          credentials: "same-origin",
          cache: "no-store",
        });
        if (response.status === 401) {
          window.location.assign(`/login?next=${encodeURIComponent(location.pathname + location.search)}`);
          return;
        }
        if (!response.ok) throw new Error(`HTTP ${response.status}`);
        const html = await response.text();
        setStale(false);
        if (html !== last) {
          const saved = followState(container);
          container.innerHTML = html;
          last = container.innerHTML;
          restoreFollow(container, saved);
          container.dispatchEvent(new CustomEvent("live:updated", { bubbles: true }));
        }
        if (container.querySelector("[data-live-final]") && timer) {
          clearInterval(timer);
          timer = null;
          document.querySelectorAll(".live-dot").forEach((dot) => dot.remove());
        }
      } catch (error) {
        setStale(true);
      } finally {
        busy = false;
      }
    }

    restoreFollow(container, new Map());
    if (!container.querySelector("[data-live-final]")) {
      timer = setInterval(() => {
        if (!document.hidden) refresh();
      }, Number(container.dataset.liveEvery) || POLL_MS);
    }
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden && timer) refresh();
    });
    container.liveRefresh = refresh;
  }

  // ---- Confirmations ------------------------------------------------------------

  document.addEventListener("submit", (event) => {
    const form = event.target.closest("form[data-confirm]");
    if (form && !window.confirm(form.dataset.confirm)) event.preventDefault();
  });

  // ---- Model upload -------------------------------------------------------------

  function setupUpload(section) {
    const allowed = new Set(JSON.parse(section.dataset.allowed || "[]"));
    const pooling = new RegExp(section.dataset.pooling || "^$");
    const required = JSON.parse(section.dataset.required || "[]");
    const maxBytes = Number(section.dataset.maxBytes) || Infinity;
    const form = section.querySelector("#upload-form");
    const dropzone = section.querySelector("#dropzone");
    const pickFolder = section.querySelector("#pick-folder");
    const pickFiles = section.querySelector("#pick-files");
    const nameInput = section.querySelector("#upload-name");
    const submit = section.querySelector("#upload-submit");
    const cancel = section.querySelector("#upload-cancel");
    const selection = section.querySelector("#upload-selection");
    const summary = section.querySelector("#upload-summary");
    const list = section.querySelector("#upload-files");
    const skippedNote = section.querySelector("#upload-skipped");
    const progress = section.querySelector("#upload-progress");
    const bar = section.querySelector("#upload-bar");
    const progressText = section.querySelector("#upload-progress-text");
    const message = section.querySelector("#upload-message");

    let chosen = []; // [{ path, file }]
    let problem = null;
    let nameWasSuggested = true;
    let xhr = null;

    nameInput.addEventListener("input", () => {
      nameWasSuggested = nameInput.value === "";
      updateButton();
    });

    function isAllowed(path) {
      return allowed.has(path) || pooling.test(path);
    }

    function showMessage(kind, text, link) {
      message.replaceChildren();
      if (!text) return;
      const box = el("div", { class: `alert alert-${kind}`, role: kind === "error" ? "alert" : "status" }, text);
      if (link) {
        box.append(" ");
        box.append(el("a", { href: link.href }, link.text));
      }
      message.append(box);
    }

    function updateButton() {
      submit.disabled = xhr !== null || chosen.length === 0 || problem !== null || nameInput.value.trim() === "";
    }

    // entries: [{ path, file }] with paths relative to the model folder.
    function choose(entries, folderName) {
      showMessage();
      const seen = new Set();
      chosen = [];
      const skipped = [];
      for (const entry of entries) {
        if (!isAllowed(entry.path) || seen.has(entry.path)) {
          skipped.push(entry.path);
          continue;
        }
        seen.add(entry.path);
        chosen.push(entry);
      }
      chosen.sort((a, b) => a.path.localeCompare(b.path));
      const total = chosen.reduce((sum, entry) => sum + entry.file.size, 0);
      const missing = required.filter((path) => !seen.has(path));
      problem = null;
      if (chosen.length === 0) problem = "None of these files belongs in a model folder.";
      else if (missing.length) problem = `Missing ${missing.join(", ")}; a model needs ${required.join(", ")}.`;
      else if (total > maxBytes) problem = `The files add up to ${bytes(total)}, more than this server accepts (${bytes(maxBytes)}).`;

      list.replaceChildren(
        ...chosen.map((entry) => {
          const item = el("li", {}, entry.path);
          item.append(el("span", { class: "size" }, bytes(entry.file.size)));
          return item;
        }),
      );
      summary.textContent = `${chosen.length} ${chosen.length === 1 ? "file" : "files"} · ${bytes(total)} to upload`;
      skippedNote.hidden = skipped.length === 0;
      skippedNote.textContent = `skipped: ${skipped.join(", ")}`;
      selection.hidden = entries.length === 0;
      if (problem) showMessage("error", problem);
      if (folderName && (nameWasSuggested || nameInput.value === "")) {
        nameInput.value = folderName.replace(/[^A-Za-z0-9_.-]+/g, "-").replace(/^[.-]+/, "").slice(0, 128);
        nameWasSuggested = true;
      }
      updateButton();
    }

    // A folder input gives `top/sub/file`; the model's paths start below `top`.
    function fromInput(files) {
      let folderName = null;
      const entries = Array.from(files).map((file) => {
        const relative = file.webkitRelativePath || file.name;
        const parts = relative.split("/");
        if (parts.length > 1) {
          folderName = folderName || parts[0];
          return { path: parts.slice(1).join("/"), file };
        }
        return { path: file.name, file };
      });
      return { entries, folderName };
    }

    pickFolder.addEventListener("change", () => {
      const { entries, folderName } = fromInput(pickFolder.files);
      choose(entries, folderName);
    });
    pickFiles.addEventListener("change", () => {
      const { entries } = fromInput(pickFiles.files);
      choose(entries, null);
    });

    // Drag and drop keeps sub-folders by walking the dropped directory.
    function readAll(reader) {
      return new Promise((resolve, reject) => {
        const all = [];
        const next = () =>
          reader.readEntries((batch) => {
            if (batch.length === 0) resolve(all);
            else {
              all.push(...batch);
              next();
            }
          }, reject);
        next();
      });
    }

    async function walk(entry, prefix, out) {
      if (entry.isFile) {
        const file = await new Promise((resolve, reject) => entry.file(resolve, reject));
        out.push({ path: prefix + entry.name, file });
      } else if (entry.isDirectory) {
        for (const child of await readAll(entry.createReader())) {
          await walk(child, `${prefix}${entry.name}/`, out);
        }
      }
    }

    ["dragenter", "dragover"].forEach((type) =>
      dropzone.addEventListener(type, (event) => {
        event.preventDefault();
        dropzone.classList.add("over");
      }),
    );
    ["dragleave", "drop"].forEach((type) => dropzone.addEventListener(type, () => dropzone.classList.remove("over")));
    dropzone.addEventListener("drop", async (event) => {
      event.preventDefault();
      const roots = Array.from(event.dataTransfer.items || [])
        .map((item) => (item.webkitGetAsEntry ? item.webkitGetAsEntry() : null))
        .filter(Boolean);
      if (roots.length === 1 && roots[0].isDirectory) {
        const entries = [];
        for (const child of await readAll(roots[0].createReader())) await walk(child, "", entries);
        choose(entries, roots[0].name);
      } else if (roots.length) {
        const entries = [];
        for (const root of roots) await walk(root, "", entries);
        choose(entries, null);
      } else {
        choose(Array.from(event.dataTransfer.files).map((file) => ({ path: file.name, file })), null);
      }
    });

    function finish() {
      xhr = null;
      cancel.hidden = true;
      bar.classList.remove("working");
      window.removeEventListener("beforeunload", holdPage);
      updateButton();
    }

    function holdPage(event) {
      event.preventDefault();
      event.returnValue = "";
    }

    form.addEventListener("submit", (event) => {
      event.preventDefault();
      if (submit.disabled) return;
      const name = nameInput.value.trim();
      const body = new FormData();
      body.append("name", name);
      for (const entry of chosen) body.append("files", entry.file, entry.path);

      xhr = new XMLHttpRequest();
      xhr.open("POST", "/models/upload");
      xhr.setRequestHeader("X-Requested-With", "XMLHttpRequest");
      xhr.responseType = "json";
      showMessage();
      progress.hidden = false;
      cancel.hidden = false;
      bar.style.width = "0%";
      progressText.textContent = "Starting upload…";
      updateButton();
      window.addEventListener("beforeunload", holdPage);

      xhr.upload.addEventListener("progress", (e) => {
        if (!e.lengthComputable) return;
        const percent = Math.floor((e.loaded / e.total) * 100);
        bar.style.width = `${percent}%`;
        bar.parentElement.setAttribute("aria-valuenow", String(percent));
        progressText.textContent = `${percent}% · ${(e.loaded / 1e6).toFixed(1)} of ${(e.total / 1e6).toFixed(1)} MB sent`;
      });
      xhr.upload.addEventListener("load", () => {
        bar.style.width = "100%";
        bar.classList.add("working");
        progressText.textContent = "All bytes sent; the server is checking the files…";
      });
      xhr.addEventListener("load", () => {
        const status = xhr.status;
        const reply = xhr.response;
        finish();
        if (status === 201 && reply) {
          progress.hidden = true;
          showMessage("success", `Registered ${reply.name} (${bytes(reply.size_bytes)}, ${reply.files.length} files).`, {
            href: `/models/${reply.id}`,
            text: "Open it",
          });
          chosen = [];
          selection.hidden = true;
          form.reset();
          nameWasSuggested = true;
          updateButton();
          const table = document.querySelector("#models-table");
          if (table && table.liveRefresh) table.liveRefresh();
        } else {
          progress.hidden = true;
          const text =
            (reply && reply.error && reply.error.message) || `The upload failed with HTTP ${status}; check the server's log.`;
          showMessage("error", text, status === 401 ? { href: "/login?next=/models", text: "Sign in" } : null);
        }
      });
      xhr.addEventListener("error", () => {
        finish();
        progress.hidden = true;
        showMessage("error", "The connection broke before the upload finished; check that the server is running and try again.");
      });
      xhr.addEventListener("abort", () => {
        finish();
        progress.hidden = true;
        showMessage("info", "Upload cancelled; nothing was registered.");
      });
      xhr.send(body);
    });

    cancel.addEventListener("click", () => {
      if (xhr) xhr.abort();
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    document.querySelectorAll("[data-live]").forEach(startLive);
    const upload = document.querySelector("#upload[data-allowed]");
    if (upload) setupUpload(upload);
  });
})();
