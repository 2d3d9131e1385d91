// The playground's wiring: settings, conversations, the streaming request and its speed line, and
// the server panel. Model output only ever reaches the page through markdown.js (text nodes).

import { APIError, getJSON, getText, streamEvents } from "./api.js";
import { drawChart } from "./chart.js";
import { renderMarkdown } from "./markdown.js";
import { ServerHistory, parseMetrics } from "./metrics.js";
import { Conversations, apiKeyStore, settingsStore } from "./store.js";

const $ = (id) => document.getElementById(id);
const METRICS_EVERY_MS = 2000;
const CHART_SPAN_MS = 300 * 1000;
const SETTING_IDS = ["system", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop-strings", "extra"];

const EXAMPLES = {
  json_schema: {
    prompt: "Describe Paris as JSON with city, country and population.",
    extra: {
      response_format: {
        type: "json_schema",
        json_schema: {
          name: "city",
          schema: {
            type: "object",
            required: ["city", "country", "population"],
            additionalProperties: false,
            properties: { city: { type: "string" }, country: { type: "string" }, population: { type: "integer" } },
          },
        },
      },
    },
  },
  regex: {
    prompt: "When did people first land on the Moon? Answer with a date.",
    extra: { structured_outputs: { regex: "[0-9]{4}-[0-9]{2}-[0-9]{2}" } },
  },
  tool: {
    prompt: "What is the weather like in Paris?",
    extra: {
      tools: [
        {
          type: "function",
          function: {
            name: "get_weather",
            description: "The current weather in a city.",
            parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
          },
        },
      ],
      tool_choice: "required",
    },
  },
};

const conversations = new Conversations();
const history = new ServerHistory();
let controller = null; // the AbortController of the answer streaming now

// ------------------------------------------------------------------------------------- settings

function mode() {
  return document.querySelector('input[name="mode"]:checked').value;
}

function saveSettings() {
  const settings = { mode: mode(), model: $("model").value };
  for (const id of SETTING_IDS) settings[id] = $(id).value;
  settingsStore.save(settings);
}

function loadSettings() {
  const settings = settingsStore.load();
  for (const id of SETTING_IDS) if (typeof settings[id] === "string") $(id).value = settings[id];
  const radio = document.querySelector(`input[name="mode"][value="${settings.mode === "completion" ? "completion" : "chat"}"]`);
  radio.checked = true;
  return settings;
}

function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

// The request body from the knobs; the extra JSON is merged last so it can set any API field.
function requestBody(promptOrMessages) {
  let extra = {};
  const extraText = $("extra").value.trim();
  if (extraText) {
    try {
      extra = JSON.parse(extraText);
    } catch (e) {
      throw new APIError(0, `Extra request fields are not valid JSON: ${e.message}`);
    }
  }
  const stop = $("stop-strings").value.split("\n").filter((s) => s !== "");
  const body = {
    model: $("model").value || undefined,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    top_p: numberField("top_p"),
    top_k: numberField("top_k"),
    max_tokens: numberField("max_tokens"),
    seed: numberField("seed"),
    stop: stop.length ? stop : undefined,
  };
  if (mode() === "chat") body.messages = promptOrMessages;
  else body.prompt = promptOrMessages;
  return { ...body, ...extra };
}

// --------------------------------------------------------------------------------- conversation

function messageView(message) {
  const view = document.createElement("div");
  view.className = `msg ${message.role}`;
  const content = document.createElement("div");
  content.className = "content";
  const speed = document.createElement("div");
  speed.className = "speed";
  view.append(content, speed);
  fillMessage(view, message);
  return view;
}

function fillMessage(view, message) {
  const content = view.querySelector(".content");
  if (message.role === "assistant") content.replaceChildren(renderMarkdown(message.content));
  else content.textContent = message.content;
  for (const call of message.toolCalls || []) {
    const pre = document.createElement("pre");
    pre.className = "tool-call";
    pre.textContent = `tool call: ${call.name}(${call.arguments})`;
    content.append(pre);
  }
  view.querySelector(".speed").textContent = message.speed || "";
  view.dataset.state = message.state || "done";
}

function renderConversation() {
  const c = conversations.current();
  $("messages").replaceChildren(...c.messages.map(messageView));
  $("messages").scrollTop = $("messages").scrollHeight;
  const items = conversations.all.map((conv) => {
    const li = document.createElement("li");
    if (conv.id === c.id) li.className = "current";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = conv.title;
    open.addEventListener("click", () => select(conv.id));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "remove";
    remove.textContent = "×";
    remove.title = "Delete this conversation";
    remove.addEventListener("click", () => {
      conversations.remove(conv.id);
      renderConversation();
    });
    li.append(open, remove);
    return li;
  });
  $("conversations").replaceChildren(...items);
}

function select(id) {
  if (controller) return; // one answer at a time: finish or stop it first
  conversations.select(id);
  renderConversation();
}

function formatStats({ t0, tFirst, tLast, deltas, usage, finish, stopped }) {
  const parts = [];
  if (stopped) parts.push("stopped");
  if (tFirst !== null) parts.push(`TTFT ${Math.round(tFirst - t0)} ms`);
  const generated = usage ? usage.completion_tokens : deltas;
  // Decode speed: the tokens after the first over the time they took.
  if (tFirst !== null && tLast > tFirst && generated > 1) parts.push(`${((generated - 1) / ((tLast - tFirst) / 1000)).toFixed(1)} tok/s`);
  if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
  else parts.push(`~${deltas} tokens`);
  if (finish) parts.push(`finish: ${finish}`);
  return parts.join(" · ");
}

async function send(text) {
  const c = conversations.current();
  const chat = mode() === "chat";
  let body;
  try {
    const earlier = c.messages.filter((m) => m.role === "user" || (m.role === "assistant" && m.content));
    const system = $("system").value.trim();
    const messages = [...(system ? [{ role: "system", content: system }] : []), ...earlier.map(({ role, content }) => ({ role, content })), { role: "user", content: text }];
    body = requestBody(chat ? messages : text);
  } catch (e) {
    showStatus(e.message, true);
    return;
  }
  c.messages.push({ role: "user", content: text });
  const answer = { role: "assistant", content: "", state: "streaming", toolCalls: [] };
  c.messages.push(answer);
  conversations.save();
  renderConversation();
  const view = $("messages").lastElementChild;
  const stats = { t0: performance.now(), tFirst: null, tLast: null, deltas: 0, usage: null, finish: null, stopped: false };
  controller = new AbortController();
  setBusy(true);
  try {
    for await (const chunk of streamEvents(chat ? "v1/chat/completions" : "v1/completions", body, apiKeyStore.load(), controller.signal)) {
      if (chunk.usage) stats.usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const delta = chat ? choice.delta?.content : choice.text;
      for (const call of (chat && choice.delta?.tool_calls) || []) {
        const slot = (answer.toolCalls[call.index ?? 0] ??= { name: "", arguments: "" });
        slot.name += call.function?.name || "";
        slot.arguments += call.function?.arguments || "";
      }
      if (delta || choice.delta?.tool_calls) {
        stats.tFirst ??= performance.now();
        stats.tLast = performance.now();
        stats.deltas += 1;
        answer.content += delta || "";
      }
      if (choice.finish_reason) stats.finish = choice.finish_reason;
      answer.speed = formatStats(stats);
      fillMessage(view, answer);
      $("messages").scrollTop = $("messages").scrollHeight;
    }
    answer.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      stats.stopped = true;
      answer.state = "stopped";
    } else {
      answer.state = "error";
      answer.error = e.message;
      showStatus(e.message, true);
    }
  } finally {
    controller = null;
    setBusy(false);
  }
  answer.speed = answer.error ? `error: ${answer.error}` : formatStats(stats);
  fillMessage(view, answer);
  conversations.save();
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function showStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

// ------------------------------------------------------------------------------ models, metrics

async function loadModels(preferred) {
  try {
    const { data } = await getJSON("v1/models", apiKeyStore.load());
    const options = data.map((card) => {
      const option = document.createElement("option");
      option.value = card.id;
      // A server of several models says each one's state (loaded, loading, unloaded, failed).
      const state = card.state && card.state !== "loaded" ? ` (${card.state})` : "";
      option.textContent = card.parent ? `${card.id} (LoRA on ${card.parent})` : `${card.id}${state}`;
      if (card.error) option.title = card.error;
      return option;
    });
    $("model").replaceChildren(...options);
    if (data.some((card) => card.id === preferred)) $("model").value = preferred;
    const adapters = data.filter((card) => card.parent).length;
    showStatus(`${data.length - adapters} model${adapters ? `, ${adapters} LoRA adapter${adapters === 1 ? "" : "s"}` : ""}`);
  } catch (e) {
    $("model").replaceChildren();
    showStatus(e.message, true);
  }
}

function formatSeconds(values) {
  if (!values || values.every((v) => v === null)) return "–";
  return values.map((v) => (v === null ? "–" : v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`)).join(" / ");
}

async function pollMetrics() {
  try {
    history.add(parseMetrics(await getText("metrics", apiKeyStore.load())));
    const last = history.latest();
    $("m-running").textContent = last.running ?? "–";
    $("m-waiting").textContent = last.waiting ?? "–";
    $("m-kv").textContent = last.kv === null ? "–" : `${(last.kv * 100).toFixed(1)}%`;
    $("m-ttft").textContent = formatSeconds(history.percentiles("ttft"));
    $("m-tpot").textContent = formatSeconds(history.percentiles("tpot"));
    drawChart($("chart"), history.points, CHART_SPAN_MS);
  } catch {
    $("m-running").textContent = "–"; // server gone or /metrics closed: keep the page usable
  }
  setTimeout(pollMetrics, METRICS_EVERY_MS);
}

// ----------------------------------------------------------------------------------------- init

function init() {
  const settings = loadSettings();
  $("api-key").value = apiKeyStore.load();
  $("api-key").addEventListener("change", () => {
    apiKeyStore.save($("api-key").value.trim());
    loadModels($("model").value);
  });
  for (const id of SETTING_IDS) $(id).addEventListener("change", saveSettings);
  for (const radio of document.querySelectorAll('input[name="mode"]')) radio.addEventListener("change", saveSettings);
  $("model").addEventListener("change", saveSettings);
  // Models load and unload as requests come: their states are read again when the picker is opened.
  $("model").addEventListener("focus", () => loadModels($("model").value));
  for (const button of document.querySelectorAll("[data-example]")) {
    button.addEventListener("click", () => {
      const example = EXAMPLES[button.dataset.example];
      $("extra").value = example ? JSON.stringify(example.extra, null, 2) : "";
      if (example && !$("prompt").value.trim()) $("prompt").value = example.prompt;
      saveSettings();
    });
  }
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("new-chat").addEventListener("click", () => {
    if (controller) return;
    conversations.create();
    renderConversation();
  });
  renderConversation();
  loadModels(settings.model);
  pollMetrics();
}

init();
