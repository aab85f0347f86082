// The local chat page: streams answers from /v1/chat/completions and draws each step's time.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];   // the conversation as the model sees it: {role, content}
const answers = [];   // per answer: {steps: [...], summary, el}
let selected = null;  // the answer whose steps the panel shows
let keyed = false;    // the endpoint wants an API key (client-api --api-keys)
const COLORS = { client: "#4f7cff", network: "#f5a524", server: "#2fb380", tokens: "#1d2330" };

async function loadInfo() {
  const info = await (await fetch("/splitllm/info")).json();
  keyed = info.api_key;
  $("model").textContent = info.model;
  $("server").textContent = info.server ? `middle layers on ${info.server}` : "middle layers in this process";
  for (const mode of info.modes) {
    const option = new Option(mode, mode, mode === info.decode, mode === info.decode);
    $("decode").add(option);
  }
}

function addMessage(role, text) {
  const hint = document.querySelector(".hint");
  if (hint) hint.remove();
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  el.append(body);
  $("messages").append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

// Decode steps only: the first step is the prefill, paid once per answer.
const decodeSteps = (answer) => answer.steps.slice(1);

function figures(answer) {
  const steps = decodeSteps(answer);
  const tokens = steps.reduce((n, s) => n + s.accepted, 0);
  const ms = steps.reduce((n, s) => n + s.total_ms, 0);
  return { tokens, steps: steps.length, tps: ms > 0 ? (tokens / ms) * 1000 : 0,
           tpr: steps.length ? tokens / steps.length : 0 };
}

function mean(steps, key) {
  return steps.length ? steps.reduce((n, s) => n + s[key], 0) / steps.length : 0;
}

function render() {
  const answer = selected;
  if (!answer) return;
  const f = figures(answer);
  $("tps").textContent = f.steps ? f.tps.toFixed(1) : "–";
  $("tpr").textContent = f.steps ? f.tpr.toFixed(2) : "–";
  $("nsteps").textContent = String(answer.steps.length);
  const steps = decodeSteps(answer);
  if (steps.length) {
    const parts = ["client_ms", "network_ms", "server_ms"].map((k) => mean(steps, k).toFixed(1));
    const mode = answer.decode ? ` (${answer.decode})` : "";
    $("breakdown").textContent =
      `mean step ${mean(steps, "total_ms").toFixed(1)} ms = client ${parts[0]} + network ${parts[1]} + ` +
      `server ${parts[2]}; prefill ${answer.steps[0].total_ms.toFixed(0)} ms${mode}`;
  }
  drawChart($("chart"), steps);
}

function drawChart(canvas, steps) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width, height = Math.round(width * 0.43);
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const pad = { left: 42, right: 34, top: 12, bottom: 24 };
  const w = width - pad.left - pad.right, h = height - pad.top - pad.bottom;
  const top = Math.max(10, ...steps.map((s) => s.client_ms + s.network_ms + s.server_ms)) * 1.1;
  const maxTokens = Math.max(4, ...steps.map((s) => s.accepted));
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#6b7280";
  ctx.strokeStyle = "#e3e6eb";
  ctx.textAlign = "right";
  for (let i = 0; i <= 4; i++) {  // grid and the ms axis
    const y = pad.top + h - (h * i) / 4;
    ctx.beginPath(); ctx.moveTo(pad.left, y); ctx.lineTo(pad.left + w, y); ctx.stroke();
    ctx.fillText(((top * i) / 4).toFixed(0), pad.left - 6, y + 4);
  }
  ctx.textAlign = "left";
  for (let i = 0; i <= maxTokens; i += Math.ceil(maxTokens / 4)) {  // the tokens axis
    ctx.fillText(String(i), pad.left + w + 6, pad.top + h - (h * i) / maxTokens + 4);
  }
  ctx.textAlign = "center";
  ctx.fillText(steps.length ? `decode steps 1–${steps.length}` : "waiting for the first decode step",
               pad.left + w / 2, height - 6);
  const slot = w / Math.max(steps.length, 24);
  const bar = Math.max(1, slot * 0.75);
  steps.forEach((s, i) => {
    let y = pad.top + h;
    const x = pad.left + i * slot + (slot - bar) / 2;
    for (const part of ["client", "network", "server"]) {
      const dh = (h * s[`${part}_ms`]) / top;
      ctx.fillStyle = COLORS[part];
      ctx.fillRect(x, y - dh, bar, dh);
      y -= dh;
    }
  });
  ctx.fillStyle = COLORS.tokens;
  steps.forEach((s, i) => {
    const x = pad.left + i * slot + slot / 2, y = pad.top + h - (h * s.accepted) / maxTokens;
    ctx.beginPath(); ctx.arc(x, y, Math.min(3, Math.max(1.5, slot / 4)), 0, 2 * Math.PI); ctx.fill();
  });
  canvas.dataset.steps = String(steps.length);
}

function select(answer) {
  if (selected && selected.el) selected.el.classList.remove("selected");
  selected = answer;
  answer.el.classList.add("selected");
  render();
}

async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 2);
      if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

async function send(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const el = addMessage("assistant", "");
  el.classList.add("streaming");
  const answer = { steps: [], el, decode: $("decode").value, text: "" };
  answers.push(answer);
  el.addEventListener("click", () => select(answer));
  select(answer);
  const body = { messages: history, stream: true, temperature: 0, max_tokens: 256, decode: answer.decode };
  const headers = { "Content-Type": "application/json" };
  if (keyed) {  // asked once per tab, kept for this tab only
    if (!sessionStorage.getItem("apiKey")) sessionStorage.setItem("apiKey", prompt("API key for this endpoint") || "");
    headers.Authorization = `Bearer ${sessionStorage.getItem("apiKey")}`;
  }
  const response = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(body) });
  if (response.status === 401) sessionStorage.removeItem("apiKey");
  if (!response.ok) throw new Error((await response.json()).error.message);
  for await (const data of events(response)) {
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);
    const choice = chunk.choices[0];
    if (choice && choice.delta && choice.delta.content) {
      answer.text += choice.delta.content;
      el.querySelector(".text").textContent = answer.text;
    }
    if (chunk.splitllm) {
      answer.steps.push(chunk.splitllm.step);
      if (chunk.splitllm.steps !== undefined) answer.summary = chunk.splitllm;
      if (selected === answer) render();
    }
    el.scrollIntoView({ block: "end" });
  }
  el.classList.remove("streaming");
  el.dataset.done = "true";
  const f = figures(answer);
  const meta = document.createElement("span");
  meta.className = "meta";
  const tokens = answer.summary ? answer.summary.new_tokens : f.tokens + 1;
  meta.textContent = `${answer.decode} · ${tokens} tokens · ${f.tpr.toFixed(2)} tok/round trip · ${f.tps.toFixed(1)} tok/s`;
  el.append(meta);
  history.push({ role: "assistant", content: answer.text });
}

$("composer").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text) return;
  $("prompt").value = "";
  $("send").disabled = true;
  try {
    await send(text);
  } catch (err) {
    const last = answers[answers.length - 1];
    if (last) last.el.classList.remove("streaming");
    addMessage("error", `error: ${err.message}`);
    history.pop();
  } finally {
    $("send").disabled = false;
    $("prompt").focus();
  }
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

window.addEventListener("resize", render);
loadInfo();
