/* Whitney console playground: a chat streamed from POST /v1/chat/completions (OpenAI's wire format), with one
 * model, or two side by side ("Compare with"): each prompt goes to both, each pane keeps its own conversation.
 *
 * The request has stream: true; the answer is server-sent events, one `data: {chat.completion.chunk}`
 * per event and `data: [DONE]` at the end, read here with a ReadableStream reader and shown as each
 * chunk arrives. With API keys on, a short-lived token of the signed-in key, asked of the console
 * (GET /console/playground/token) for each chat, is sent as `Authorization: Bearer`, as any API client
 * sends one: the sign-in cookie is HttpOnly, so this script never sees the key or the cookie.
 *
 * Waiting: the first chunk (the assistant's role) comes at once and carries the sampling operation's id
 * ("chatcmpl-<op id>"); until the first token, the pane asks GET /console/playground/wait?op=<id> what the
 * request waits behind (the engine trains and samples in turns) and says so: "Queued behind 2 operations
 * (1 forward_backward running, 1 optim_step queued) · 12 s".
 */
(function () {
  "use strict";

  const BASE = document.body.dataset.base;
  const API = BASE.replace(/\/console$/, "");  // the API's root: where /console is mounted
  const WAIT_MS = 700;
  const $ = (id) => document.getElementById(id);
  // Each pane: its model picker, its messages box, its conversation so far ({role, content}), its request.
  const panes = [{ model: "model", box: "messages", empty: "chat-empty" }, { model: "model-b", box: "messages-b", empty: "chat-empty-b" }]
    .map((p) => ({ model: $(p.model), box: $(p.box), empty: $(p.empty), messages: [], controller: null }));

  /* A token for the API as the signed-in key (null: the server needs none). */
  async function token() {
    const r = await fetch(BASE + "/playground/token", { headers: { Accept: "application/json" }, credentials: "same-origin" });
    if (!r.ok) throw new Error("signed out: sign in again (HTTP " + r.status + ")");
    return (await r.json()).token;
  }

  function active() { return panes[1].model.value ? panes : panes.slice(0, 1); }

  function layout() {
    const two = active().length === 2;
    $("panes").classList.toggle("two", two);
    $("pane-b").hidden = !two;
    document.querySelectorAll(".pane-head").forEach((h, i) => { h.hidden = !two; h.textContent = panes[i].model.value; });
  }

  function bubble(pane, role, text) {
    pane.empty.hidden = true;
    const wrap = document.createElement("div");
    wrap.className = "msg " + role;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = role === "user" ? "You" : role === "error" ? "Error" : pane.model.value;
    const body = document.createElement("div");
    body.className = "bubble";
    body.textContent = text;
    wrap.append(who, body);
    pane.box.appendChild(wrap);
    pane.box.scrollTop = pane.box.scrollHeight;
    return wrap;
  }

  function busy(on) {
    $("send").hidden = on;
    $("stop").hidden = !on;
    $("prompt").disabled = on;
  }

  /* Split server-sent events out of `buffer`; returns [events' data strings, the unfinished rest]. */
  function takeEvents(buffer) {
    const events = [];
    let cut;
    buffer = buffer.replace(/\r\n/g, "\n");
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data) events.push(data);
    }
    return [events, buffer];
  }

  function errorText(status, body) {
    if (body && body.error && body.error.message) return body.error.message;
    if (body && body.message) return body.message + (body.field ? " (field " + body.field + ")" : "");
    return "HTTP " + status;
  }

  function waitText(w) {
    const secs = " · " + Math.round(w.waited_s) + " s";
    if (w.ahead > 0) {
      const parts = w.behind.map((b) => b.count + " " + b.kind + " " + b.status);
      return "Queued behind " + w.ahead + " operation" + (w.ahead === 1 ? "" : "s") + " (" + parts.join(", ") + ")" + secs;
    }
    return (w.status === "queued" ? "Queued" : "Starting") + secs;
  }

  /* Until `waiting()` turns false: what the operation waits behind, in `line`. */
  async function showWait(opId, line, waiting) {
    while (waiting()) {
      try {
        const r = await fetch(BASE + "/playground/wait?op=" + encodeURIComponent(opId), { headers: { Accept: "application/json" }, credentials: "same-origin" });
        if (r.ok && waiting()) {
          const w = await r.json();
          line.textContent = waitText(w);
          line.dataset.ahead = String(w.ahead);
          line.hidden = false;
        }
      } catch (e) { /* the next try, or the answer, comes */ }
      await new Promise((resolve) => setTimeout(resolve, WAIT_MS));
    }
  }

  /* One pane's answer to `text`, streamed into a new assistant bubble. */
  async function answer(pane, text) {
    pane.messages.push({ role: "user", content: text });
    bubble(pane, "user", text);
    const reply = bubble(pane, "assistant", "");
    reply.classList.add("streaming");
    const out = reply.querySelector(".bubble");
    const line = document.createElement("div");
    line.className = "wait";
    line.hidden = true;
    const stats = document.createElement("div");
    stats.className = "stats";
    reply.append(line, stats);
    const system = $("system").value.trim();
    const payload = {
      model: pane.model.value,
      messages: (system ? [{ role: "system", content: system }] : []).concat(pane.messages),
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number($("temperature").value),
      top_p: Number($("top_p").value),
      max_tokens: Number($("max_tokens").value),
    };
    const headers = { "Content-Type": "application/json", Accept: "text/event-stream" };
    pane.controller = new AbortController();
    const started = performance.now();
    let first = null, chunks = 0, finish = null, text_ = "", usage = null, waiting = true;
    try {
      const bearer = await token();
      if (bearer) headers.Authorization = "Bearer " + bearer;
      const r = await fetch(API + "/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(payload), signal: pane.controller.signal });
      if (!r.ok) {
        let body = null;
        try { body = await r.json(); } catch (e) { /* not JSON */ }
        throw new Error(errorText(r.status, body));
      }
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "", done = false;
      while (!done) {
        const { value, done: ended } = await reader.read();
        if (ended) break;
        let events;
        [events, buffer] = takeEvents(buffer + decoder.decode(value, { stream: true }));
        for (const data of events) {
          if (data === "[DONE]") { done = true; break; }
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(errorText(0, chunk));
          if (chunk.usage) usage = chunk.usage;
          if (!reply.dataset.op && chunk.id) {
            reply.dataset.op = chunk.id.replace(/^chatcmpl-/, "");
            showWait(reply.dataset.op, line, () => waiting);
          }
          const choice = (chunk.choices || [])[0];
          if (!choice) continue;
          const piece = (choice.delta && choice.delta.content) || "";
          if (piece) {
            waiting = false;
            line.hidden = true;
            if (first === null) first = performance.now();
            chunks += 1;
            text_ += piece;
            out.textContent = text_;
            reply.dataset.chunks = String(chunks);
            pane.box.scrollTop = pane.box.scrollHeight;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
      pane.messages.push({ role: "assistant", content: text_ });
      const end = performance.now();
      const rate = first !== null && end > first && chunks > 1 ? ((chunks - 1) / ((end - first) / 1000)).toFixed(1) + " chunks/s · " : "";
      const tokens = usage ? usage.completion_tokens + " tokens in " : "";
      stats.textContent = tokens + chunks + " chunks · " + (first === null ? "" : Math.round(first - started) + " ms to first · ") + rate + "finish: " + (finish || "—");
      reply.dataset.finish = finish || "";
    } catch (e) {
      if (e.name === "AbortError") {
        stats.textContent = "stopped after " + chunks + " chunks";
        pane.messages.push({ role: "assistant", content: text_ });
      } else {
        pane.messages.pop();  // the question was not answered: it is not part of the conversation
        reply.remove();
        bubble(pane, "error", e.message);
      }
    } finally {
      waiting = false;
      line.hidden = true;
      reply.classList.remove("streaming");
      reply.dataset.done = "true";
      pane.controller = null;
    }
  }

  async function send(text) {
    busy(true);
    try {
      await Promise.all(active().map((pane) => answer(pane, text)));
    } finally {
      busy(false);
      $("prompt").focus();
    }
  }

  function start() {
    ["temperature", "top_p"].forEach((id) => {
      const show = () => { $(id + "-out").textContent = Number($(id).value).toFixed(2); };
      $(id).addEventListener("input", show);
      show();
    });
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("prompt").value.trim();
      if (!text || panes.some((p) => p.controller)) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
    });
    $("stop").addEventListener("click", () => panes.forEach((p) => p.controller && p.controller.abort()));
    $("clear").addEventListener("click", () => {
      panes.forEach((p) => {
        if (p.controller) p.controller.abort();
        p.messages.length = 0;
        p.box.querySelectorAll(".msg").forEach((m) => m.remove());
        p.empty.hidden = false;
      });
    });
    [["model", "model"], ["model-b", "compare"]].forEach(([id, param]) => $(id).addEventListener("change", () => {
      const url = new URL(window.location.href);
      if ($(id).value) url.searchParams.set(param, $(id).value);
      else url.searchParams.delete(param);
      history.replaceState(null, "", url);
      layout();
    }));
    layout();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
