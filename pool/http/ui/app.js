// llm-pool dashboard: plain browser JavaScript, no framework, no build step.
//
// Everything shown comes from the admin API with the operator's token: the state from
// one Server-Sent Events stream (GET /v1/admin/events, pushed on change, no polling),
// actions from the admin routes, the chat from POST /v1/responses with `stream: true`.
// Data is only ever written with textContent, never parsed as HTML.
"use strict";

const TOKEN_KEY = "llm-pool.admin-token";
const FINAL_PULLS = new Set(["success", "error", "cancelled"]);
// Rules across fields that the backends check (pool/backends/*.py check_load_override)
// and that a field's own constraint cannot say.
const PATTERNS = {
  exllama_cache_quant: [/^[2-8](,[2-8])?$/, "'<bits>' or '<k_bits>,<v_bits>', bits 2 to 8"],
};
const EXCLUSIVE = [["exllama_cache_quant", ["exllama_cache_k_bits", "exllama_cache_v_bits"]]];

const $ = (id) => document.getElementById(id);
let state = null; // the last `state` event

// -- HTTP ---------------------------------------------------------------------------------
// Relative to the page (/ui/), so a proxy that adds a path prefix keeps working.
const url = (path) => new URL(path, document.baseURI).href;

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

function authHeaders(extra = {}) {
  const headers = { ...extra };
  if (token()) headers.Authorization = `Bearer ${token()}`;
  return headers;
}

function errorText(status, body) {
  const error = body && body.error;
  if (typeof error === "string") return `${error} (${status})`; // Ollama's format
  if (!error) return `the pool answered ${status}`;
  const lines = [`${error.message || error.code} (${error.code || "error"}, ${status})`];
  for (const item of error.errors || []) {
    lines.push(`field ${(item.loc || []).join(".") || "body"}: ${item.msg}`);
  }
  return lines.join("\n");
}

class ApiError extends Error {
  constructor(status, body) {
    super(errorText(status, body));
    this.status = status;
  }
}

async function call(method, path, body) {
  const init = { method, headers: authHeaders(), cache: "no-store" };
  if (body !== undefined) {
    init.headers["content-type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(url(path), init);
  const data = await response.json().catch(() => null);
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

// Server-Sent Events from a fetch response (EventSource cannot send Authorization).
async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (!line || line.startsWith(":")) continue;
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "event") event = text;
          else if (field === "data") data.push(text);
        }
        if (data.length) yield { event, data: data.join("\n") };
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// -- small helpers --------------------------------------------------------------------------
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key === "width") node.style.width = value; // CSSOM: the page's CSP forbids style attributes
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function mib(value) {
  if (value === null || value === undefined) return "?";
  return value >= 1024 ? `${(value / 1024).toFixed(1)} GiB` : `${Math.round(value)} MiB`;
}

function bytes(value) {
  if (value === null || value === undefined) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (value >= 1024 && i < units.length - 1) {
    value /= 1024;
    i += 1;
  }
  return `${value.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function showNotice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

function setLive(status, text) {
  $("live").dataset.status = status;
  $("live").textContent = text || status;
}

// -- the live state stream ----------------------------------------------------------------
let liveAbort = null;
let retryMs = 1000;

async function connect() {
  if (liveAbort) liveAbort.abort();
  const abort = new AbortController();
  liveAbort = abort;
  setLive("connecting");
  try {
    const response = await fetch(url("../v1/admin/events"), {
      headers: authHeaders({ accept: "text/event-stream" }),
      signal: abort.signal,
      cache: "no-store",
    });
    if (response.status === 401) {
      setLive("token", "token needed");
      showNotice("This pool needs its admin token: enter it above (it is kept for this tab only).");
      return; // until a token is entered
    }
    if (!response.ok) {
      throw new Error(errorText(response.status, await response.json().catch(() => null)));
    }
    setLive("live");
    showNotice("");
    retryMs = 1000;
    // The stream brings the decisions made from now on; the ones before come from the ring.
    resetDecisions();
    loadDecisions(abort.signal);
    for await (const event of sseEvents(response)) {
      if (event.event === "state") render(JSON.parse(event.data));
      else if (event.event === "decision") addDecision(JSON.parse(event.data));
    }
  } catch (err) {
    if (abort.signal.aborted) return;
    showNotice(`the state stream broke off: ${err.message}`);
  }
  if (abort.signal.aborted || liveAbort !== abort) return;
  setLive("reconnecting");
  setTimeout(() => liveAbort === abort && connect(), retryMs);
  retryMs = Math.min(retryMs * 2, 10000);
}

function render(next) {
  state = next;
  if (next.shutting_down) showNotice("The pool is shutting down; this page reconnects when it is back.");
  renderGpus(next);
  renderModels(next.models);
  renderPulls(next.pulls);
  renderChatModels(next.models);
  refreshUsage();
}

// -- GPU memory -----------------------------------------------------------------------------
// Each replica's share of each GPU it runs on: `gpus` lists a replica's GPUs (several when
// it is split), `gpu_split_mib` the MiB planned on each (docs/vram.md, "Placement").
function shares(row) {
  const out = [];
  (row.gpus || []).forEach((entry, replica) => {
    const gpus = Array.isArray(entry) ? entry : [entry]; // a flat list: older pools
    const split = (row.gpu_split_mib || [])[replica] || [];
    gpus.forEach((gpu, i) => out.push({ gpu, planned: typeof split[i] === "number" ? split[i] : 0 }));
  });
  return out;
}

// What a model holds on GPU `index`: its measured load delta where there is one, else its
// estimate, divided over its GPUs as the placement planned.
function heldOn(row, index) {
  const all = shares(row);
  const here = all.filter((s) => s.gpu === index);
  if (!here.length) return null;
  const measured = row.observed_load_delta !== null && row.observed_load_delta !== undefined;
  const plannedAll = all.reduce((sum, s) => sum + s.planned, 0);
  const plannedHere = here.reduce((sum, s) => sum + s.planned, 0);
  const total = measured ? row.observed_load_delta : plannedAll || row.vram_estimate_mib;
  if (total === null || total === undefined) return null;
  const fraction = plannedAll > 0 ? plannedHere / plannedAll : here.length / all.length;
  return { mib: total * fraction, measured };
}

function gpuNames(row) {
  // "0, 1" for two replicas on two GPUs, "0+1" for one replica split over both.
  return (row.gpus || []).map((g) => (Array.isArray(g) ? g.join("+") : String(g))).join(", ");
}

function renderGpus(next) {
  const box = $("gpus");
  if (!next.gpus.length) {
    // The error says why in an operator's words ("no NVIDIA GPU found: models run on the CPU ...").
    box.replaceChildren(el("p", { class: "muted", text: next.gpu_error || "no GPU found" }));
    return;
  }
  box.replaceChildren(
    ...next.gpus.map((gpu) => {
      const bar = el("div", { class: "bar", role: "img" });
      const chips = [];
      let pool = 0;
      for (const row of next.models) {
        if (row.parent) continue; // an adapter's memory is its base's row
        const held = heldOn(row, gpu.index);
        if (!held) continue;
        pool += held.mib;
        const kind = held.measured ? "measured" : "estimate";
        const what = held.measured ? "measured" : `estimate, ${row.vram_estimate_basis}`;
        const title = `${row.name}: ${mib(held.mib)} (${what})`;
        bar.append(el("div", { class: `seg ${kind}`, title, width: `${(100 * held.mib) / gpu.total_mib}%` }));
        chips.push(`${row.name} ${held.measured ? "" : "~"}${mib(held.mib)}`);
      }
      const other = gpu.used_mib - pool;
      if (other > 0) {
        bar.append(el("div", { class: "seg other", title: `other: ${mib(other)}`, width: `${(100 * other) / gpu.total_mib}%` }));
      }
      const percent = Math.round((100 * gpu.used_mib) / gpu.total_mib);
      bar.setAttribute("aria-label", `GPU ${gpu.index}: ${percent}% used`);
      return el(
        "div",
        { class: "gpu", "data-gpu": gpu.index },
        el(
          "div",
          { class: "gpu-head" },
          el("span", { text: `GPU ${gpu.index} · ${gpu.name}` }),
          el("span", { class: "num", text: `${mib(gpu.used_mib)} / ${mib(gpu.total_mib)} (${percent}%)` }),
        ),
        bar,
        el("div", { class: "muted", text: chips.join(" · ") || "no model here" }),
      );
    }),
  );
}

// -- models ---------------------------------------------------------------------------------
const rows = new Map(); // model name -> its DOM parts, kept across updates
const busy = new Set(); // models with a load or unload request under way

function renderModels(models) {
  const table = $("models");
  const names = new Set(models.map((m) => m.name));
  for (const [name, entry] of rows) {
    if (!names.has(name)) {
      entry.body.remove();
      rows.delete(name);
    }
  }
  models.forEach((row, index) => {
    let entry = rows.get(row.name);
    if (!entry) {
      entry = modelEntry(row.name);
      rows.set(row.name, entry);
    }
    // The server's order. A row is moved only when out of place: moving it would take
    // the focus from a load form being typed into.
    const here = table.tBodies[index];
    if (here !== entry.body) table.insertBefore(entry.body, here || null);
    updateModel(entry, row);
  });
}

function modelEntry(name) {
  const parts = {
    name: el("div", { class: "name", text: name }),
    backend: el("div", { class: "backend" }),
    state: el("span", { class: "state" }),
    error: el("div", { class: "last-error" }),
    replicas: el("td", { class: "num replicas" }),
    inflight: el("td", { class: "num inflight" }),
    queue: el("td", { class: "num queue" }),
    memoryText: el("div", { class: "memory" }),
    memoryBar: el("div", { class: "bar small" }),
    actionError: el("div", { class: "last-error action-error" }),
  };
  const entry = { name, row: null, form: null, parts };
  parts.load = el("button", { type: "button", text: "Load…", onclick: () => toggleLoadForm(entry) });
  parts.unload = el("button", { type: "button", text: "Unload", onclick: () => unload(entry) });
  parts.pull = el("button", { type: "button", text: "Pull", onclick: () => startPull(entry) });
  const main = el(
    "tr",
    { class: "model" },
    el("td", {}, parts.name, parts.backend),
    el("td", {}, parts.state, parts.error),
    parts.replicas,
    parts.inflight,
    parts.queue,
    el("td", {}, parts.memoryText, parts.memoryBar),
    el("td", { class: "actions" }, parts.load, parts.unload, parts.pull, parts.actionError),
  );
  entry.body = el("tbody", { "data-model": name }, main);
  return entry;
}

function updateModel(entry, row) {
  entry.row = row;
  const p = entry.parts;
  const d = row.definition || {};
  const notes = [row.resolved_backend];
  // A LoRA adapter: served by its base (its row's state and numbers are the base's).
  if (row.parent) notes.unshift(`LoRA adapter of ${row.parent} (+${mib(row.adapter.size_mib)})`);
  if (row.adapters?.length) notes.push(`${row.adapters.length} adapter(s)`);
  if (row.kind && row.kind !== "chat") notes.push(row.kind);
  if (d.on_demand) notes.push("on demand");
  if (d.pinned) notes.push("pinned");
  if (!row.configured_enabled) notes.push("not loaded at start");
  // What the artifact's metadata says: family, size, quantization, context.
  const facts = row.details || {};
  const about = [facts.family, facts.parameter_size, facts.quantization_level].filter(Boolean);
  if (about.length) notes.push(about.join(" "));
  if (facts.served_context_length) notes.push(`ctx ${facts.served_context_length}`);
  p.backend.textContent = notes.join(" · ");
  p.backend.title = facts.context_length ? `trained context ${facts.context_length}` : "";
  // An output canary that found the model degraded shows beside its state, with the reason.
  const degraded = row.canary?.health === "degraded";
  p.state.textContent = degraded ? `${row.runtime_state}, degraded` : row.runtime_state;
  p.state.dataset.state = degraded ? "degraded" : row.runtime_state;
  const evicted = row.runtime_state === "unloaded" && row.unload_reason === "evicted";
  p.error.textContent =
    row.last_error ||
    (degraded ? `degraded: ${row.canary.reason}` : "") ||
    (evicted ? "evicted: its next request loads it again" : "");
  p.replicas.textContent = `${row.loaded_replicas}/${row.replicas}`;
  p.replicas.title = `loaded / current count, at most ${row.replica_max}`;
  p.inflight.textContent = String(row.runtime_inflight);
  p.inflight.title = `running now; each replica runs up to ${row.effective_target_inflight} at once`;
  p.queue.textContent = String(row.queue_depth);
  renderModelMemory(p, row);

  const settled = row.runtime_state === "unloaded" || row.runtime_state === "failed";
  const working = busy.has(row.name);
  // An adapter loads and unloads with its base: no buttons of its own.
  p.load.hidden = !settled || Boolean(row.parent);
  p.load.disabled = working;
  p.unload.hidden = settled || Boolean(row.parent);
  p.unload.disabled = working || row.runtime_state === "unloading";
  const pull = (state.pulls || []).find((x) => x.model === row.name);
  p.pull.hidden = !d.source;
  p.pull.disabled = Boolean(pull && !FINAL_PULLS.has(pull.status));
  if (!settled && entry.form && !entry.form.submitting) closeLoadForm(entry);
}

function renderModelMemory(p, row) {
  // Held now only while loaded; an unloaded row's measurement is the estimate's basis.
  const measured = row.is_loaded ? row.observed_load_delta : null;
  const estimate = row.vram_estimate_mib;
  const text = [];
  if (measured !== null && measured !== undefined) text.push(`${mib(measured)} measured`);
  if (estimate !== null && estimate !== undefined) {
    text.push(`~${mib(estimate)} est. (${row.vram_estimate_basis.replaceAll("_", " ")})`);
  }
  if ((row.gpus || []).length) text.push(`GPU ${gpuNames(row)}`);
  p.memoryText.textContent = text.join(" · ") || "no estimate";
  const top = Math.max(measured || 0, estimate || 0);
  const segs = [];
  if (top > 0 && measured) segs.push(el("div", { class: "seg measured", width: `${(100 * measured) / top}%` }));
  if (top > 0 && estimate && estimate > (measured || 0)) {
    segs.push(el("div", { class: "seg estimate", width: `${(100 * (estimate - (measured || 0))) / top}%` }));
  }
  p.memoryBar.replaceChildren(...segs);
  p.memoryBar.hidden = !segs.length;
  p.memoryBar.title = "solid: measured; pale: the estimate beyond it";
}

async function unload(entry) {
  entry.parts.actionError.textContent = "";
  busy.add(entry.name);
  updateModel(entry, entry.row);
  try {
    await call("POST", `../v1/admin/models/${encodeURIComponent(entry.name)}/unload`);
  } catch (err) {
    entry.parts.actionError.textContent = err.message;
  } finally {
    busy.delete(entry.name);
    const latest = state.models.find((m) => m.name === entry.name);
    if (latest) updateModel(entry, latest);
  }
}

// -- the load form: generated from load_constraints and load_recommendations ----------------
function toggleLoadForm(entry) {
  if (entry.form) closeLoadForm(entry);
  else openLoadForm(entry);
}

function closeLoadForm(entry) {
  entry.form.tr.remove();
  entry.form = null;
}

// The value a load would use for `field` if the form leaves it out (key presence counts).
function effective(row, field) {
  const override = row.load_override || {};
  const value = field in override ? override[field] : (row.definition || {})[field];
  if (value === null || value === undefined) return row.load_constraints[field]?.default;
  return value;
}

function fieldControl(row, name, rule) {
  const id = `load-${row.name}-${name}`.replace(/[^A-Za-z0-9_-]/g, "_");
  const current = effective(row, name);
  const shown = current === undefined ? "backend default" : current === null ? "null" : String(current);
  const hint = [];
  let control;
  let read;
  let examples = null;
  const nullable = rule.kind === "string_or_null" || rule.kind === "integer_or_null";
  if (rule.allowed_values || rule.kind === "enum") {
    // A constrained select: "as configured" leaves the field out of the body.
    control = el("select", { id, name }, el("option", { value: "", text: `as configured (${shown})` }));
    if (nullable) {
      const meaning = rule.null_means || (rule.default !== undefined && rule.default !== null ? rule.default : "default");
      control.append(el("option", { value: "__null__", text: `null (${meaning})` }));
    }
    for (const value of rule.allowed_values || []) {
      control.append(el("option", { value: JSON.stringify(value), text: String(value) }));
    }
    read = () => {
      if (control.value === "") return { set: false };
      if (control.value === "__null__") return { set: true, value: null };
      return { set: true, value: JSON.parse(control.value) };
    };
  } else if (rule.kind === "integer" || rule.kind === "integer_or_null" || rule.kind === "float") {
    const integer = rule.kind !== "float";
    control = el("input", {
      id,
      name,
      type: "number",
      inputmode: integer ? "numeric" : "decimal",
      min: rule.minimum,
      max: rule.maximum,
      step: integer ? rule.step || 1 : "any",
      placeholder: shown,
    });
    if (rule.minimum !== undefined) hint.push(`≥ ${rule.minimum}`);
    if (rule.maximum !== undefined) hint.push(`≤ ${rule.maximum}`);
    if (integer && rule.step > 1) hint.push(`multiple of ${rule.step}`);
    if (rule.unit) hint.push(rule.unit);
    read = () => {
      const text = control.value.trim();
      if (text === "") {
        // A number input reports an unparsable entry as "" with badInput set.
        return control.validity.badInput ? { set: true, problem: "not a number" } : { set: false };
      }
      const value = Number(text);
      if (!Number.isFinite(value)) return { set: true, problem: "not a number" };
      if (integer && !Number.isInteger(value)) return { set: true, problem: "must be a whole number" };
      if (rule.minimum !== undefined && value < rule.minimum) return { set: true, problem: `must be at least ${rule.minimum}` };
      if (rule.maximum !== undefined && value > rule.maximum) return { set: true, problem: `must be at most ${rule.maximum}` };
      if (integer && rule.step > 1 && value % rule.step) return { set: true, problem: `must be a multiple of ${rule.step}` };
      return { set: true, value };
    };
  } else {
    // string_or_null without a fixed list, or a kind this page does not know: text.
    const listId = `${id}-examples`;
    control = el("input", { id, name, type: "text", placeholder: shown, list: rule.examples ? listId : undefined, spellcheck: "false" });
    if (rule.examples) {
      examples = el("datalist", { id: listId }, ...rule.examples.map((v) => el("option", { value: String(v) })));
    }
    if (rule.format) hint.push(`format: ${rule.format}`);
    read = () => {
      const text = control.value.trim();
      if (text === "") return { set: false };
      const pattern = PATTERNS[name];
      if (pattern && !pattern[0].test(text)) return { set: true, problem: `must be ${pattern[1]}` };
      if (rule.kind === "string_or_null" || rule.kind === "enum") return { set: true, value: text };
      try {
        return { set: true, value: JSON.parse(text) };
      } catch {
        return { set: true, value: text };
      }
    };
  }
  const problem = el("div", { class: "problem", "data-problem-for": name });
  const field = el(
    "div",
    { class: "field", "data-field": name },
    el("label", { for: id, text: name }),
    control,
    examples,
    el("div", { class: "hint", text: hint.join(", ") }),
    problem,
  );
  return { name, rule, control, read, problem, field };
}

function openLoadForm(entry) {
  const row = entry.row;
  const replicaRule = { kind: "integer", minimum: 1, maximum: row.replica_max, step: 1 };
  const fields = [fieldControl({ ...row, load_constraints: { replicas: replicaRule } }, "replicas", replicaRule)];
  for (const [name, rule] of Object.entries(row.load_constraints || {})) {
    fields.push(fieldControl(row, name, rule));
  }
  const byName = Object.fromEntries(fields.map((f) => [f.name, f]));
  const groups = [];
  const presets = el("div", { class: "presets" });
  const notes = [];
  for (const [name, rec] of Object.entries(row.load_recommendations || {})) {
    if (rec.kind !== "pair_presets") continue;
    const members = (rec.fields || []).filter((f) => byName[f]);
    if (members.length > 1) groups.push(members);
    presets.append(el("span", { class: "muted", text: `${name.replaceAll("_", " ")}:` }));
    for (const pair of rec.recommended_pairs || []) {
      presets.append(
        el("button", {
          type: "button",
          text: pair.label,
          onclick: () => {
            for (const f of members) setControl(byName[f], pair[f]);
            check();
          },
        }),
      );
    }
    notes.push(...(rec.notes || []));
  }
  const per = row.vram_estimate_mib === null ? null : row.vram_estimate_mib / Math.max(1, row.vram_estimate_replica_count);
  const vram = el("div", { class: "hint vram" });
  const formProblem = el("div", { class: "form-problem" });
  const serverError = el("div", { class: "server-error", role: "alert" });
  const submit = el("button", { type: "submit", class: "primary", text: "Load" });
  const form = el(
    "form",
    { novalidate: true, "aria-label": `load ${row.name}` },
    el("div", { class: "fields" }, ...fields.map((f) => f.field)),
    presets.childElementCount ? presets : null,
    ...notes.map((n) => el("div", { class: "hint", text: n })),
    vram,
    formProblem,
    el(
      "div",
      { class: "form-buttons" },
      submit,
      el("button", { type: "button", text: "Cancel", onclick: () => closeLoadForm(entry) }),
    ),
    serverError,
  );

  // Every rule the page knows is checked on each change; Load stays disabled until the
  // whole combination is valid. The server checks again, and its answer is shown as is.
  function check() {
    const values = {};
    const problems = [];
    for (const f of fields) {
      const got = f.read();
      f.problem.textContent = got.problem || "";
      f.control.classList.toggle("invalid", Boolean(got.problem));
      if (got.problem) problems.push(`${f.name} ${got.problem}`);
      else if (got.set) values[f.name] = got.value;
    }
    for (const members of groups) {
      const set = members.filter((m) => m in values);
      if (set.length && set.length !== members.length) {
        problems.push(`${members.join(" and ")} go together: set both (a preset sets both)`);
      } else if (set.length && new Set(set.map((m) => values[m] === null)).size > 1) {
        problems.push(`${members.join(" and ")}: both null or both set`);
      }
    }
    for (const [one, others] of EXCLUSIVE) {
      if (one in values && others.some((o) => o in values)) {
        problems.push(`${one} cannot be combined with ${others.join("/")}`);
      }
    }
    const replicas = values.replicas ?? row.definition?.replicas ?? 1;
    vram.textContent =
      per === null
        ? "VRAM: no estimate for this model"
        : `VRAM: about ${mib(per * replicas)} for ${replicas} replica(s) (${row.vram_estimate_basis.replaceAll("_", " ")})`;
    formProblem.textContent = problems.join("; ");
    submit.disabled = problems.length > 0 || entry.form?.submitting;
    return problems.length ? null : values;
  }

  form.addEventListener("input", check);
  form.addEventListener("change", check);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const values = check();
    if (!values || entry.form.submitting) return;
    entry.form.submitting = true;
    submit.disabled = true;
    submit.textContent = "Loading…";
    serverError.textContent = "";
    busy.add(row.name);
    updateModel(entry, entry.row);
    try {
      await call("POST", `../v1/admin/models/${encodeURIComponent(row.name)}/load`, values);
      entry.form.submitting = false;
      closeLoadForm(entry);
    } catch (err) {
      serverError.textContent = `The pool refused the load: ${err.message}`;
      entry.form.submitting = false;
      submit.textContent = "Load";
      check();
    } finally {
      busy.delete(row.name);
      const latest = state.models.find((m) => m.name === row.name);
      if (latest) updateModel(entry, latest);
    }
  });

  const tr = el("tr", { class: "load-form" }, el("td", { colspan: 7 }, form));
  entry.body.append(tr);
  entry.form = { tr, submitting: false };
  check();
  fields[0].control.focus();
}

function setControl(field, value) {
  if (field.control.tagName === "SELECT") {
    field.control.value = value === null ? "__null__" : JSON.stringify(value);
  } else {
    field.control.value = value === null || value === undefined ? "" : String(value);
  }
}

// -- decisions ------------------------------------------------------------------------------
// The residency owner's decisions (docs/vram.md): the latest from GET /v1/admin/decisions
// when the stream (re)connects, then each new one as a `decision` event. Newest first, by
// `seq`, each shown once however it arrived.
const DECISIONS_SHOWN = 50;
const shownDecisions = new Set(); // seq of every row shown

function resetDecisions() {
  shownDecisions.clear(); // a restarted pool counts seq from 1 again
  $("decision-rows").replaceChildren();
  $("decisions-empty").hidden = false;
}

async function loadDecisions(signal) {
  try {
    const data = await call("GET", `../v1/admin/decisions?limit=${DECISIONS_SHOWN}`);
    if (!signal.aborted) for (const decision of data.decisions) addDecision(decision);
  } catch (err) {
    if (!signal.aborted) showNotice(`the decisions could not be read: ${err.message}`);
  }
}

function clock(at) {
  const when = new Date(at * 1000);
  return [when.getHours(), when.getMinutes(), when.getSeconds()]
    .map((n) => String(n).padStart(2, "0"))
    .join(":");
}

function addDecision(decision) {
  if (shownDecisions.has(decision.seq)) return;
  shownDecisions.add(decision.seq);
  const row = el(
    "tr",
    { "data-seq": decision.seq, "data-action": decision.action },
    el("td", { class: "num at", text: clock(decision.at), title: new Date(decision.at * 1000).toISOString() }),
    el("td", {}, el("span", { class: "action", text: decision.action })),
    el("td", { class: "model", text: decision.model }),
    el("td", { class: "for", text: decision.for || "" }),
    el("td", { class: "reason", text: decision.reason }),
  );
  const body = $("decision-rows");
  const after = [...body.rows].find((r) => Number(r.dataset.seq) < decision.seq);
  body.insertBefore(row, after || null);
  while (body.rows.length > DECISIONS_SHOWN) {
    const last = body.rows[body.rows.length - 1];
    shownDecisions.delete(Number(last.dataset.seq));
    last.remove();
  }
  $("decisions-empty").hidden = true;
}

// -- pulls ----------------------------------------------------------------------------------
const pulls = new Map(); // model -> {node, parts, last sample for the rate}

async function startPull(entry) {
  entry.parts.actionError.textContent = "";
  entry.parts.pull.disabled = true;
  try {
    // The pull runs in the pool; its progress arrives with the state events, so only the
    // first progress line is read (leaving stops watching, not the pull).
    const response = await fetch(url("../api/pull"), {
      method: "POST",
      headers: authHeaders({ "content-type": "application/json" }),
      body: JSON.stringify({ model: entry.name }),
    });
    if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
    await response.body.getReader().cancel();
  } catch (err) {
    entry.parts.actionError.textContent = err.message;
    entry.parts.pull.disabled = false;
  }
}

function renderPulls(list) {
  const box = $("pulls");
  if (!list.length) return;
  if (!pulls.size) box.replaceChildren();
  const now = performance.now();
  [...list].sort((a, b) => b.started_at - a.started_at).forEach((pull, index) => {
    let item = pulls.get(pull.model);
    if (!item) {
      const parts = {
        what: el("span", { class: "what" }),
        numbers: el("span", { class: "num" }),
        fill: el("div", { class: "seg" }),
        error: el("div", { class: "last-error" }),
        path: el("div", { class: "muted path" }),
        cancel: el("button", { type: "button", text: "Cancel" }),
      };
      parts.cancel.addEventListener("click", async () => {
        parts.cancel.disabled = true;
        try {
          await call("DELETE", `../api/pull/${encodeURIComponent(pull.model)}`);
        } catch (err) {
          parts.error.textContent = err.message;
        }
      });
      const node = el(
        "div",
        { class: "pull", "data-pull": pull.model },
        el("div", { class: "pull-head" }, parts.what, parts.numbers, parts.cancel),
        el("div", { class: "bar" }, parts.fill),
        parts.error,
        parts.path,
      );
      item = { node, parts, sample: null };
      pulls.set(pull.model, item);
    }
    const here = box.children[index];
    if (here !== item.node) box.insertBefore(item.node, here || null);
    const p = item.parts;
    const done = FINAL_PULLS.has(pull.status);
    item.node.dataset.status = pull.status;
    const file = pull.file && !done ? ` · ${pull.file}` : "";
    p.what.textContent = `${pull.model}: ${pull.status}${file}`;
    const numbers = [`${bytes(pull.completed)} of ${pull.total ? bytes(pull.total) : "?"}`];
    if (pull.files_total > 1) numbers.push(`file ${pull.files_done}/${pull.files_total}`);
    if (!done && item.sample && now > item.sample.t) {
      const rate = ((pull.completed - item.sample.completed) * 1000) / (now - item.sample.t);
      if (rate > 0) {
        numbers.push(`${bytes(rate)}/s`);
        if (pull.total) numbers.push(`${Math.ceil((pull.total - pull.completed) / rate)} s left`);
      }
    }
    item.sample = { t: now, completed: pull.completed };
    p.numbers.textContent = numbers.join(" · ");
    const fraction = pull.total ? pull.completed / pull.total : pull.status === "success" ? 1 : 0;
    p.fill.style.width = `${Math.min(100, 100 * fraction)}%`;
    p.error.textContent = pull.error || "";
    p.path.textContent = pull.status === "success" && pull.path ? `pulled to ${pull.path}` : "";
    p.cancel.hidden = done;
  });
}

// -- chat -----------------------------------------------------------------------------------
const chat = { history: [], abort: null };

function renderChatModels(models) {
  const select = $("chat-model");
  const servable = models.filter(
    (m) => m.kind === "chat" && (m.runtime_state === "loaded" || m.definition?.on_demand),
  );
  const previous = select.value;
  const names = servable.map((m) => m.name);
  $("chat-send").disabled = !names.length || Boolean(chat.abort);
  if (names.length && names.join("\n") === [...select.options].map((o) => o.value).join("\n")) return;
  select.replaceChildren(...names.map((n) => el("option", { value: n, text: n })));
  if (!names.length) select.append(el("option", { value: "", text: "no loaded model" }));
  if (names.includes(previous)) select.value = previous;
  renderThinking();
}

// Thinking on or off, for models whose backend can switch it per request.
function renderThinking() {
  const select = $("chat-thinking");
  const row = (state?.models || []).find((m) => m.name === $("chat-model").value);
  const modes = row?.capabilities?.thinking_modes || ["default"];
  const current = select.value;
  if (modes.join() !== [...select.options].map((o) => o.value).join()) {
    select.replaceChildren(...modes.map((m) => el("option", { value: m, text: `thinking: ${m}` })));
    if (modes.includes(current)) select.value = current;
  }
  select.hidden = modes.length < 2;
}

function chatMessage(role, text) {
  const body = el("span", { class: "text", text });
  const node = el("div", { class: `msg ${role}` }, body);
  $("chat-log").append(node);
  node.scrollIntoView({ block: "end" });
  return { node, body };
}

async function sendChat() {
  const model = $("chat-model").value;
  const text = $("chat-input").value.trim();
  if (!model || !text || chat.abort) return;
  $("chat-input").value = "";
  const row = (state?.models || []).find((m) => m.name === model);
  const multiTurn = Boolean(row?.capabilities?.multi_turn);
  if (!multiTurn) chat.history = [];
  chat.history.push({ role: "user", content: text });
  chatMessage("user", text);
  const answer = chatMessage("assistant", "");
  answer.node.dataset.model = model;
  const meta = el("span", { class: "meta", text: `${model} …` });
  answer.node.append(meta);
  const body = { model, stream: true };
  const thinking = $("chat-thinking");
  if (!thinking.hidden && thinking.value && thinking.value !== "default") body.thinking = thinking.value;
  if (multiTurn) body.messages = chat.history.slice();
  else body.input = text;
  const abort = new AbortController();
  chat.abort = abort;
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  let reply = "";
  let ended = "stopped";
  try {
    const response = await fetch(url("../v1/responses"), {
      method: "POST",
      headers: authHeaders({ "content-type": "application/json", accept: "text/event-stream" }),
      body: JSON.stringify(body),
      signal: abort.signal,
    });
    if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
    for await (const event of sseEvents(response)) {
      const data = JSON.parse(event.data);
      if (event.event === "response.output_text.delta") {
        reply += data.delta;
        answer.body.textContent = reply;
        answer.node.scrollIntoView({ block: "end" });
      } else if (event.event === "response.completed") {
        const r = data.response || {};
        const m = r.metrics || {};
        const facts = [model, r.finish_reason];
        if (m.engine_output_tokens) facts.push(`${m.engine_output_tokens} tokens`);
        if (m.engine_tokens_per_second) facts.push(`${m.engine_tokens_per_second.toFixed(1)} tokens/s`);
        ended = facts.filter(Boolean).join(" · ");
      } else if (event.event === "error") {
        throw new Error(errorText("stream", data));
      }
    }
  } catch (err) {
    if (!abort.signal.aborted) {
      answer.node.classList.add("error");
      ended = err.message;
    }
  } finally {
    chat.abort = null;
    meta.textContent = ended;
    $("chat-stop").disabled = true;
    $("chat-send").disabled = !$("chat-model").value;
  }
  // A failed turn leaves no trace in the history; a stopped one keeps what came.
  if (answer.node.classList.contains("error")) chat.history.pop();
  else chat.history.push({ role: "assistant", content: reply });
}

// -- usage ----------------------------------------------------------------------------------
// Tokens per tenant over the last day (GET /v1/admin/usage). Usage is not part of the
// state stream: it is read again when a state event arrives, at most every USAGE_EVERY_MS,
// so a busy pool costs one small query per ten seconds and an idle one none.
const USAGE_EVERY_MS = 10000;
let usageReadAt = 0;
let usageReading = false;

async function refreshUsage() {
  const now = Date.now();
  if (usageReading || now - usageReadAt < USAGE_EVERY_MS) return;
  usageReading = true;
  usageReadAt = now;
  const since = Math.floor(now / 1000) - 86400;
  try {
    const body = await call("GET", `../v1/admin/usage?group_by=tenant&since=${since}`);
    renderUsage(body.usage);
  } catch (err) {
    // 409 usage_disabled: recording is off (service.usage.enabled).
    const text = err.status === 409 ? "usage recording is off" : `usage unavailable: ${err.message}`;
    $("usage-rows").replaceChildren(el("tr", {}, el("td", { colspan: 5, class: "muted", text })));
  } finally {
    usageReading = false;
  }
}

function renderUsage(usage) {
  if (!usage.length) {
    $("usage-rows").replaceChildren(el("tr", {}, el("td", { colspan: 5, class: "muted", text: "no request in the last 24 hours" })));
    return;
  }
  const total = (row) => row.prompt_tokens + row.output_tokens;
  const most = Math.max(...usage.map(total), 1);
  const sorted = [...usage].sort((a, b) => total(b) - total(a));
  $("usage-rows").replaceChildren(
    ...sorted.map((row) =>
      el(
        "tr",
        { "data-tenant": row.tenant },
        el("th", { scope: "row", text: row.tenant }),
        el("td", { class: "num", text: row.requests.toLocaleString() }),
        el("td", { class: "num", text: row.prompt_tokens.toLocaleString() }),
        el("td", { class: "num", text: row.output_tokens.toLocaleString() }),
        el(
          "td",
          {},
          el(
            "div",
            { class: "bar", role: "img", "aria-label": `${row.tenant}: ${total(row)} tokens` },
            el("div", { class: "seg measured", width: `${(100 * row.prompt_tokens) / most}%`, title: `prompt: ${row.prompt_tokens}` }),
            el("div", { class: "seg estimate", width: `${(100 * row.output_tokens) / most}%`, title: `output: ${row.output_tokens}` }),
          ),
        ),
      ),
    ),
  );
}

// -- start ----------------------------------------------------------------------------------
function start() {
  $("token").value = token();
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("token").value.trim();
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
    connect();
  });
  $("token-forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    $("token").value = "";
    connect();
  });
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sendChat();
  });
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      sendChat();
    }
  });
  $("chat-model").addEventListener("change", renderThinking);
  $("chat-stop").addEventListener("click", () => chat.abort && chat.abort.abort());
  $("chat-clear").addEventListener("click", () => {
    chat.history = [];
    $("chat-log").replaceChildren();
  });
  connect();
}

start();
