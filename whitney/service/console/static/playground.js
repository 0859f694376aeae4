/* Whitney console playground: a chat streamed from POST /v1/chat/completions (OpenAI's wire format).
 *
 * The request has stream: true; the answer is server-sent events, one `data: {chat.completion.chunk}`
 * per event and `data: [DONE]` at the end, read here with a ReadableStream reader and shown as each
 * chunk arrives. With API keys on, the key the console signed in with (its cookie) is sent as
 * `Authorization: Bearer`, as any API client sends it.
 */
(function () {
  "use strict";

  const COOKIE = "whitney_console_key";
  const API = document.body.dataset.base.replace(/\/console$/, "");  // the API's root: where /console is mounted
  const $ = (id) => document.getElementById(id);
  const messages = [];  // the conversation so far: {role, content}
  let controller = null;  // the AbortController of the answer streaming now

  function key() {
    const found = document.cookie.split("; ").find((c) => c.startsWith(COOKIE + "="));
    return found ? decodeURIComponent(found.slice(COOKIE.length + 1)) : null;
  }

  function bubble(role, text) {
    $("chat-empty").hidden = true;
    const wrap = document.createElement("div");
    wrap.className = "msg " + role;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = role === "user" ? "You" : role === "error" ? "Error" : $("model").value;
    const body = document.createElement("div");
    body.className = "bubble";
    body.textContent = text;
    wrap.append(who, body);
    $("messages").appendChild(wrap);
    $("messages").scrollTop = $("messages").scrollHeight;
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

  async function send(text) {
    messages.push({ role: "user", content: text });
    bubble("user", text);
    const answer = bubble("assistant", "");
    answer.classList.add("streaming");
    const out = answer.querySelector(".bubble");
    const stats = document.createElement("div");
    stats.className = "stats";
    answer.appendChild(stats);
    const system = $("system").value.trim();
    const payload = {
      model: $("model").value,
      messages: (system ? [{ role: "system", content: system }] : []).concat(messages),
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number($("temperature").value),
      top_p: Number($("top_p").value),
      max_tokens: Number($("max_tokens").value),
    };
    const headers = { "Content-Type": "application/json", Accept: "text/event-stream" };
    if (key()) headers.Authorization = "Bearer " + key();
    controller = new AbortController();
    busy(true);
    const started = performance.now();
    let first = null, chunks = 0, finish = null, text_ = "", usage = null;
    try {
      const r = await fetch(API + "/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(payload), signal: controller.signal });
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
          const choice = (chunk.choices || [])[0];
          if (!choice) continue;
          const piece = (choice.delta && choice.delta.content) || "";
          if (piece) {
            if (first === null) first = performance.now();
            chunks += 1;
            text_ += piece;
            out.textContent = text_;
            answer.dataset.chunks = String(chunks);
            $("messages").scrollTop = $("messages").scrollHeight;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
      messages.push({ role: "assistant", content: text_ });
      const end = performance.now();
      const rate = first !== null && end > first && chunks > 1 ? ((chunks - 1) / ((end - first) / 1000)).toFixed(1) + " chunks/s · " : "";
      const tokens = usage ? usage.completion_tokens + " tokens in " : "";
      stats.textContent = tokens + chunks + " chunks · " + (first === null ? "" : Math.round(first - started) + " ms to first · ") + rate + "finish: " + (finish || "—");
      answer.dataset.finish = finish || "";
    } catch (e) {
      if (e.name === "AbortError") {
        stats.textContent = "stopped after " + chunks + " chunks";
        messages.push({ role: "assistant", content: text_ });
      } else {
        messages.pop();  // the question was not answered: it is not part of the conversation
        answer.remove();
        bubble("error", e.message);
      }
    } finally {
      answer.classList.remove("streaming");
      answer.dataset.done = "true";
      controller = null;
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
      if (!text || controller) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
    });
    $("stop").addEventListener("click", () => controller && controller.abort());
    $("clear").addEventListener("click", () => {
      if (controller) controller.abort();
      messages.length = 0;
      $("messages").querySelectorAll(".msg").forEach((m) => m.remove());
      $("chat-empty").hidden = false;
    });
    $("model").addEventListener("change", () => {
      const url = new URL(window.location.href);
      url.searchParams.set("model", $("model").value);
      history.replaceState(null, "", url);
    });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
