// llamajet's chat page: streams from /v1/chat/completions of the server that
// served it. No framework, no build step, nothing fetched from elsewhere.
//
// Safety rule: model output never becomes HTML. The Markdown subset below
// builds DOM nodes with createElement / createTextNode only; no string is ever
// parsed as HTML (no innerHTML, outerHTML, insertAdjacentHTML, document.write
// or eval in this file; tests/test_chat_page.py checks that). A renderer that
// cannot create an element from text needs no sanitizer, which is why this
// page does not vendor a Markdown library plus one. The page's CSP
// (script-src 'self', no inline script) is a second wall. Links are made only
// for http(s) URLs; images are never loaded (they are shown as links).
"use strict";

const KEY = "llamajet.key";          // sessionStorage: this tab only
const CONV = "llamajet.conversation"; // localStorage: kept until cleared
const SETTINGS = "llamajet.settings";

const $ = (id) => document.getElementById(id);
const ui = {};
let messages = [];      // [{role, content, note?}]
let model = null;       // the served model's name, from /v1/models
let inflight = null;    // the AbortController of the reply being streamed

// ------------------------------------------------------------ Markdown subset

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.appendChild(document.createTextNode(text));
  return e;
}

function safeUrl(s) {
  try {
    const u = new URL(s);
    return u.protocol === "http:" || u.protocol === "https:" ? u.href : null;
  } catch (e) {
    return null;
  }
}

// Inline: `code`, **bold**, __bold__, *italic*, _italic_, [text](http(s) url).
// Underscores emphasize only outside words (snake_case and __dunder__ names in
// prose stay as written), as CommonMark's flanking rules have it.
const INLINE = /`([^`\n]+)`|\*\*(\S(?:[^*]*\S)?)\*\*|(?<![\w\\])__(\S(?:[^_]*\S)?)__(?!\w)|\*(\S(?:[^*]*\S)?)\*|(?<![\w\\])_(\S(?:[^_]*\S)?)_(?!\w)|\[([^\]\n]+)\]\(([^)\s]+)\)/;

function inline(parent, text) {
  while (text.length) {
    const m = INLINE.exec(text);
    if (!m) { parent.appendChild(document.createTextNode(text)); return; }
    if (m.index) parent.appendChild(document.createTextNode(text.slice(0, m.index)));
    if (m[1] !== undefined) parent.appendChild(el("code", null, m[1]));
    else if (m[2] !== undefined || m[3] !== undefined) inline(parent.appendChild(el("strong")), m[2] ?? m[3]);
    else if (m[4] !== undefined || m[5] !== undefined) inline(parent.appendChild(el("em")), m[4] ?? m[5]);
    else {
      const href = safeUrl(m[7]);
      if (href) {
        const a = el("a");
        a.href = href;
        a.target = "_blank";
        a.rel = "noopener noreferrer nofollow";
        inline(a, m[6]);
        parent.appendChild(a);
      } else {
        parent.appendChild(document.createTextNode(m[0]));  // javascript:, data:, relative: as text
      }
    }
    text = text.slice(m.index + m[0].length);
  }
}

function inlineLines(parent, lines) {
  lines.forEach((line, i) => {
    if (i) parent.appendChild(el("br"));
    inline(parent, line);
  });
}

function codeBlock(lines, lang) {
  const pre = el("pre");
  const code = el("code", lang ? "lang-" + lang : null, lines.join("\n"));
  pre.appendChild(code);
  if (navigator.clipboard) {
    const b = el("button", "copy", "copy");
    b.type = "button";
    b.addEventListener("click", () => navigator.clipboard.writeText(code.textContent).catch(() => {}));
    pre.appendChild(b);
  }
  return pre;
}

// Block level: fenced code (an unclosed fence runs to the end: a reply still
// streaming, or cut), headings, lists, quotes, rules, paragraphs.
function markdown(container, text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let para = [];
  const flush = () => {
    if (para.length) { inlineLines(out.appendChild(el("p")), para); para = []; }
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const f = FENCE.exec(line);
    if (f) {
      flush();
      const body = [];
      const close = new RegExp("^ {0,3}" + (f[1][0] === "`" ? "`" : "~") + "{" + f[1].length + ",}\\s*$");
      for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
      out.appendChild(codeBlock(body, f[2]));
      continue;
    }
    if (!line.trim()) { flush(); continue; }
    const h = /^ {0,3}(#{1,6})\s+(.*)$/.exec(line);
    if (h) { flush(); inline(out.appendChild(el("h" + h[1].length)), h[2]); continue; }
    if (/^ {0,3}([-*_])(\s*\1){2,}\s*$/.test(line)) { flush(); out.appendChild(el("hr")); continue; }
    const li = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/.exec(line);
    if (li) {
      flush();
      const ordered = /\d/.test(li[1][0]);
      const list = el(ordered ? "ol" : "ul");
      if (ordered && parseInt(li[1], 10) !== 1) list.start = parseInt(li[1], 10);
      let m = li;
      while (m && /\d/.test(m[1][0]) === ordered) {
        inline(list.appendChild(el("li")), m[2]);
        if (i + 1 >= lines.length) break;
        const next = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/.exec(lines[i + 1]);
        if (!next || /\d/.test(next[1][0]) !== ordered) break;
        m = next;
        i++;
      }
      out.appendChild(list);
      continue;
    }
    if (/^ {0,3}>/.test(line)) {
      flush();
      const q = [];
      for (; i < lines.length && /^ {0,3}>/.test(lines[i]); i++) q.push(lines[i].replace(/^ {0,3}> ?/, ""));
      i--;
      inlineLines(out.appendChild(el("blockquote")), q);
      continue;
    }
    para.push(line);
  }
  flush();
  container.replaceChildren(out);
}

// ------------------------------------------------------------ the page

function headers() {
  const h = { "Content-Type": "application/json" };
  const k = sessionStorage.getItem(KEY);
  if (k) h.Authorization = "Bearer " + k;
  return h;
}

// The route's own message (OpenAI's {"error": {"message"}}), else the status.
async function errorText(r) {
  let body = "";
  try { body = await r.text(); } catch (e) { /* the status says enough */ }
  try {
    const j = JSON.parse(body);
    const e = j.error ?? j;
    if (typeof e === "string") return `${r.status}: ${e}`;
    if (e && e.message) return `${r.status}: ${e.message}`;
  } catch (e) { /* not JSON */ }
  return `${r.status} ${r.statusText}${body ? ": " + body.slice(0, 300) : ""}`;
}

function showError(text) {
  ui.error.textContent = text;
  ui.error.hidden = !text;
}

function setBusy(ctl) {
  inflight = ctl;
  ui.send.hidden = !!ctl;
  ui.stop.hidden = !ctl;
  ui.send.disabled = !!ctl || !model;
}

function atBottom() {
  return ui.log.scrollHeight - ui.log.scrollTop - ui.log.clientHeight < 40;
}

function view(msg) {
  const box = el("div", "msg " + msg.role);
  const body = el("div", "body");
  box.appendChild(body);
  const note = el("div", "note");
  box.appendChild(note);
  const paint = () => {
    if (msg.role === "assistant") markdown(body, msg.content);
    else body.textContent = msg.content;  // the user's text as typed (pre-wrap)
    note.textContent = msg.note || "";
    note.hidden = !msg.note;
  };
  paint();
  ui.log.appendChild(box);
  return paint;
}

function save() {
  localStorage.setItem(CONV, JSON.stringify(messages));
}

function redraw() {
  ui.log.replaceChildren();
  messages.forEach(view);
  ui.log.scrollTop = ui.log.scrollHeight;
}

function readSettings() {
  const num = (id) => ui[id].value === "" ? undefined : Number(ui[id].value);
  return {
    temperature: num("temperature"), top_p: num("top_p"), max_tokens: num("max_tokens"),
    system: ui.system.value, schema_on: ui.schema_on.checked, schema: ui.schema.value,
  };
}

function saveSettings() {
  localStorage.setItem(SETTINGS, JSON.stringify(readSettings()));
  ui.schema.hidden = !ui.schema_on.checked;
}

function loadSettings() {
  let s = null;
  try { s = JSON.parse(localStorage.getItem(SETTINGS) || "null"); } catch (e) { s = null; }
  if (s) {
    for (const id of ["temperature", "top_p", "max_tokens"]) if (s[id] !== undefined) ui[id].value = s[id];
    if (typeof s.system === "string") ui.system.value = s.system;
    if (typeof s.schema === "string") ui.schema.value = s.schema;
    ui.schema_on.checked = !!s.schema_on;
  }
  ui.schema.hidden = !ui.schema_on.checked;
}

async function loadModel() {
  let r;
  try {
    r = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    ui.model.textContent = "server unreachable";
    showError("cannot reach the server: " + e.message);
    return;
  }
  if (r.status === 401) {
    const tried = sessionStorage.getItem(KEY);
    ui.model.textContent = "API key needed";
    ui.keyform.hidden = false;
    showError(tried ? await errorText(r) : "");
    if (tried) sessionStorage.removeItem(KEY);
    ui.key.focus();
    return;
  }
  if (r.status === 503) {  // loading (or draining): say so and look again
    ui.model.textContent = "model loading…";
    showError(await errorText(r));
    setTimeout(loadModel, 1000);
    return;
  }
  if (!r.ok) {
    showError(await errorText(r));
    return;
  }
  const j = await r.json();
  const m = j.data && j.data[0];
  model = m ? m.id : null;
  ui.model.textContent = m ? `${m.id}${m.max_model_len ? ` · context ${m.max_model_len} tokens` : ""}` : "no model";
  ui.keyform.hidden = true;
  showError("");
  setBusy(inflight);
  ui.input.focus();
}

function requestBody(s) {
  const history = messages.map((m) => ({ role: m.role, content: m.content }));
  const body = {
    model, stream: true, stream_options: { include_usage: true },
    messages: s.system.trim() ? [{ role: "system", content: s.system }, ...history] : history,
  };
  for (const k of ["temperature", "top_p", "max_tokens"]) if (s[k] !== undefined && !Number.isNaN(s[k])) body[k] = s[k];
  if (s.schema_on) {
    body.response_format = { type: "json_schema", json_schema: { name: "reply", schema: JSON.parse(s.schema), strict: true } };
  }
  return body;
}

async function send() {
  const text = ui.input.value;
  if (inflight || !model || !text.trim()) return;
  const s = readSettings();
  if (s.schema_on) {
    try { JSON.parse(s.schema); } catch (e) { showError("the JSON schema is not valid JSON: " + e.message); return; }
  }
  showError("");
  const user = { role: "user", content: text };
  messages.push(user);
  const body = requestBody(s);
  ui.input.value = "";
  view(user);
  const reply = { role: "assistant", content: "" };
  const ctl = new AbortController();
  setBusy(ctl);
  let paint = null;
  const t0 = performance.now();
  let tFirst = null, tLast = null, chunks = 0, usage = null, finish = null, stopped = false;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: ctl.signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    messages.push(reply);
    paint = view(reply);
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      // one time per read: tokens that arrive together share it, so a burst never reads as a speed
      const now = performance.now();
      buf += dec.decode(value, { stream: true });
      let cut;
      let grew = false;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const j = JSON.parse(data);
          if (j.error) throw new Error(j.error.message || JSON.stringify(j.error));
          if (j.usage) usage = j.usage;
          for (const c of j.choices || []) {
            const piece = c.delta && c.delta.content;
            if (piece) {
              reply.content += piece;
              chunks++;
              tLast = now;
              if (tFirst === null) tFirst = tLast;
              grew = true;
            }
            if (c.finish_reason) finish = c.finish_reason;
          }
        }
      }
      if (grew) {
        const follow = atBottom();
        paint();
        if (follow) ui.log.scrollTop = ui.log.scrollHeight;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      stopped = true;
    } else if (!paint) {
      // refused before any reply: the message goes back to the input, nothing is lost
      messages.pop();
      ui.log.lastChild && ui.log.removeChild(ui.log.lastChild);
      if (!ui.input.value) ui.input.value = text;
      showError(e.message);
    } else {
      showError(e.message);
    }
  } finally {
    setBusy(null);
  }
  if (paint) {
    const n = usage ? usage.completion_tokens : chunks;
    const secs = tFirst !== null && tLast > tFirst ? (tLast - tFirst) / 1000 : null;
    const parts = [];
    if (stopped) parts.push("stopped");
    else if (finish === "length") parts.push("cut at max tokens");
    else if (finish === "abort") parts.push("ended by the server");
    parts.push(`${n} tokens`);
    if (secs && n > 1) parts.push(`${((n - 1) / secs).toFixed(1)} tok/s`);
    if (tFirst !== null) parts.push(`first token ${((tFirst - t0) / 1000).toFixed(2)} s`);
    reply.note = stopped || finish === "length" || finish === "abort" ? parts[0] : "";
    paint();
    ui.stats.textContent = parts.join(" · ");
  } else if (stopped) {
    messages.pop();  // stopped before the server answered: nothing to keep
    if (ui.log.lastChild) ui.log.removeChild(ui.log.lastChild);
    if (!ui.input.value) ui.input.value = text;
  }
  save();
  ui.input.focus();
}

function init() {
  for (const id of ["model", "clear", "keyform", "key", "settings", "temperature", "top_p", "max_tokens", "system",
    "schema_on", "schema", "log", "error", "stats", "input", "send", "stop"]) ui[id] = $(id);
  try { messages = JSON.parse(localStorage.getItem(CONV) || "[]"); } catch (e) { messages = []; }
  if (!Array.isArray(messages)) messages = [];
  messages = messages.filter((m) => m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string");
  loadSettings();
  redraw();
  setBusy(null);
  for (const id of ["temperature", "top_p", "max_tokens", "system", "schema_on", "schema"]) {
    ui[id].addEventListener("change", saveSettings);
  }
  ui.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  ui.send.addEventListener("click", send);
  ui.stop.addEventListener("click", () => inflight && inflight.abort());
  ui.clear.addEventListener("click", () => {
    if (inflight) inflight.abort();
    messages = [];
    save();
    redraw();
    ui.stats.textContent = "";
    showError("");
  });
  ui.keyform.addEventListener("submit", (e) => {
    e.preventDefault();
    const k = ui.key.value.trim();
    if (!k) return;
    sessionStorage.setItem(KEY, k);
    ui.key.value = "";
    loadModel();
  });
  loadModel();
}

init();
