// The pcd-engine playground: a client of the server's public routes and of nothing else.
// A question set ({"questions": ...}) goes to POST /v1/systemone; anything else is a JSON Schema,
// sent to POST /v1/chat/completions as response_format json_schema, whose x_pcd.fields carry the
// per-field probabilities. Every text from a response is written with textContent, never as HTML.
"use strict";

const KEY_STORAGE = "pcd-playground-api-key";
const state = {
  examples: [],
  conversationExample: null, // conversation.js's "Load example conversation"
  apiKey: sessionStorage.getItem(KEY_STORAGE) || "",
  model: null,
  runs: 0,
  mode: "oneshot", // or "conversation" (conversation.js)
};

function byId(id) {
  return document.getElementById(id);
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function percent(p) {
  return `${(100 * p).toFixed(1)}%`;
}

function shown(value) {
  return typeof value === "string" ? value : JSON.stringify(value);
}

// -- talking to the server ----------------------------------------------------------------------
async function send(method, path, body) {
  const headers = {};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (state.apiKey) headers.Authorization = `Bearer ${state.apiKey}`;
  const started = performance.now();
  const init = { method, headers };
  if (body !== undefined) init.body = JSON.stringify(body);
  let response;
  try {
    response = await fetch(path, init);
  } catch (error) {
    return { ok: false, status: 0, statusText: "no answer", body: String(error), ms: performance.now() - started };
  }
  const raw = await response.text();
  const ms = performance.now() - started;
  let parsed = raw;
  try {
    parsed = JSON.parse(raw);
  } catch (ignored) {
    // not JSON (or a 204's empty body): shown as the server sent it
  }
  return { ok: response.ok, status: response.status, statusText: response.statusText, body: parsed, ms };
}

function post(path, body) {
  return send("POST", path, body);
}

function schemaName(spec) {
  const title = typeof spec.title === "string" ? spec.title : "";
  const name = title.replace(/[^A-Za-z0-9_-]+/g, "_").replace(/^_+|_+$/g, "").slice(0, 64);
  return name || "schema";
}

function isQuestionSet(spec) {
  return spec !== null && typeof spec === "object" && !Array.isArray(spec) && "questions" in spec;
}

function request(spec, text) {
  if (isQuestionSet(spec)) {
    const body = { state: text, questions: spec.questions };
    if (state.model) body.model = state.model;
    return { path: "/v1/systemone", body, read: fromSystemOne };
  }
  const format = { type: "json_schema", json_schema: { name: schemaName(spec || {}), schema: spec } };
  const body = { model: state.model || "default", messages: [{ role: "user", content: text }], response_format: format };
  return { path: "/v1/chat/completions", body, read: fromChatCompletion };
}

// -- the two wires, read into one view: per decision its value, bars, candidate mass and flags ----
function bars(probabilities, chosen, name) {
  return Object.entries(probabilities).map(([label, p]) => ({ label, p, chosen: chosen(label, p), title: name(label) }));
}

function argmax(probabilities) {
  let best = null;
  for (const [label, p] of Object.entries(probabilities)) if (best === null || p > probabilities[best]) best = label;
  return best;
}

function systemOneDecisions(answers) {
  return Object.entries(answers || {}).map(([name, answer]) => {
    const view = {
      name,
      mass: answer.x_candidate_mass,
      flags: { debiased: answer.x_debiased, calibrated: answer.x_calibrated, abstained: answer.x_abstained },
      answerSet: answer.x_answer_set,
    };
    if (answer.type === "noul") {
      const yes = answer.noul >= 0.5 ? "true" : "false";
      view.value = `${yes} (P(yes) ${answer.noul.toFixed(3)})`;
      view.bars = bars({ true: answer.noul, false: 1 - answer.noul }, (label) => label === yes, (label) => label);
    } else if (answer.type === "score") {
      const top = argmax(answer.probabilities);
      view.value = `score ${answer.score.toFixed(2)}`;
      const level = (label) => `${label} · ${shown(answer.legend[label])}`;
      view.bars = bars(answer.probabilities, (label) => label === top, level);
    } else {
      view.value = answer.choice;
      view.bars = bars(answer.probabilities, (label) => label === answer.choice, (label) => label);
    }
    return view;
  });
}

function fromSystemOne(body) {
  const decisions = systemOneDecisions(body.answers);
  const cost = [
    `${body.x_forward_passes} forward passes`,
    `${body.usage.input_tokens} tokens in`,
    `${body.usage.output_tokens} out`,
    `queue ${body.x_queue_ms.toFixed(1)} ms`,
  ];
  return { decisions, warnings: body.x_warnings || [], cost };
}

// a fill's fields (FieldResult.to_dict(), as x_pcd.fields and a session's record carry them)
function fillDecisions(fields) {
  return Object.entries(fields || {}).map(([name, field]) => {
    const view = {
      name,
      value: shown(field.value),
      mass: field.candidate_mass,
      flags: { debiased: field.debiased, calibrated: field.calibrated, abstained: field.abstained },
      answerSet: field.answer_set,
    };
    if (field.probabilities) {
      const top = argmax(field.probabilities);
      view.bars = bars(field.probabilities, (label) => label === top, (label) => label);
    } else if (field.memberships) {
      const members = new Set(field.value.map(shown));
      view.bars = bars(field.memberships, (label) => members.has(label), (label) => label);
      view.note = "each bar is that label's own probability of belonging; the list holds those at 0.5 or more";
    } else {
      view.bars = [];
      view.note = `generated: ${field.n_tokens} tokens, mean token probability ${field.mean_probability.toFixed(3)}`;
    }
    return view;
  });
}

function fromChatCompletion(body) {
  const pcd = body.x_pcd;
  const decisions = fillDecisions(pcd.fields);
  const usage = body.usage;
  const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
  const cost = [
    `${pcd.forward_passes} forward passes`,
    `${usage.prompt_tokens} tokens in (${cached} cached)`,
    `${usage.completion_tokens} out`,
    `queue ${pcd.queue_ms.toFixed(1)} ms`,
  ];
  return { decisions, warnings: pcd.warnings || [], cost };
}

// -- rendering ------------------------------------------------------------------------------------
function barRow(className, label, p, title) {
  const row = element("div", className);
  row.dataset.label = label;
  row.dataset.probability = String(p);
  const name = element("span", "bar-label", title);
  name.title = title;
  const track = element("div", "track");
  const fill = element("div", "fill");
  fill.style.width = `${Math.max(0, Math.min(1, p)) * 100}%`; // CSSOM, which the page's CSP allows
  track.append(fill);
  row.append(name, track, element("span", "percent", percent(p)));
  return { row, track };
}

function flag(text, className) {
  return element("span", `flag ${className}`, text);
}

function decisionCard(view) {
  const card = element("article", "field");
  card.dataset.field = view.name;
  // what compare mode compares: the chosen label (a score's likeliest level), not the printed number
  const chosen = view.bars.find((bar) => bar.chosen);
  card.dataset.decision = view.bars.length && !view.note ? chosen.label : view.value;
  const head = element("div", "field-head");
  head.append(element("span", "field-name", view.name), element("span", "value", view.value));
  card.append(head);
  const flags = element("div", "flags");
  // a generated field or a multi-label list carries no such flags: nothing is claimed for it
  for (const [name, on] of [["debiased", view.flags.debiased], ["calibrated", view.flags.calibrated]]) {
    if (typeof on === "boolean") flags.append(flag(on ? name : `not ${name}`, on ? "on" : ""));
  }
  if (view.flags.abstained) flags.append(flag("abstained", "alert"));
  if (typeof view.mass === "number" && view.mass < 0.5) flags.append(flag("candidate mass below 0.5", "alert"));
  card.append(flags);
  const list = element("div", "bars");
  for (const bar of view.bars) list.append(barRow(bar.chosen ? "bar chosen" : "bar", bar.label, bar.p, bar.title).row);
  card.append(list);
  if (view.note) card.append(element("div", "muted note", view.note));
  if (Array.isArray(view.answerSet)) {
    card.append(element("div", "answer-set", `answer set: {${view.answerSet.map(shown).join(", ")}}`));
  }
  if (typeof view.mass === "number") {
    const mass = barRow(view.mass < 0.5 ? "bar mass low" : "bar mass", "candidate_mass", view.mass, "candidate mass");
    mass.track.append(element("span", "half-mark"));
    mass.track.title = "the mark is at 0.5: below it the model wanted to write something that is not allowed";
    card.append(mass.row);
  }
  return card;
}

function errorPanel(title, answer, path, method = "POST") {
  const panel = element("div", "error");
  panel.dataset.status = String(answer.status);
  const route = `${method} ${path}`;
  const heading = answer.status ? `HTTP ${answer.status} ${answer.statusText} from ${route}` : `no answer from ${route}`;
  panel.append(element("h2", "", `${title}: ${heading}`));
  const body = typeof answer.body === "string" ? answer.body : JSON.stringify(answer.body, null, 2);
  panel.append(element("pre", "error-body", body));
  return panel;
}

function resultPanel(title, answer, call) {
  if (!answer.ok) return errorPanel(title, answer, call.path);
  const view = call.read(answer.body);
  const panel = element("div", "result");
  panel.append(element("h2", "", `${title} · POST ${call.path}`));
  panel.append(element("div", "cost", [...view.cost, `round trip ${Math.round(answer.ms)} ms`].join(" · ")));
  if (view.warnings.length) {
    const list = element("ul", "warnings");
    for (const warning of view.warnings) list.append(element("li", "", warning));
    panel.append(list);
  }
  const cards = element("div", "fields");
  for (const decision of view.decisions) cards.append(decisionCard(decision));
  panel.append(cards);
  return panel;
}

function compareResults(panels) {
  // Text B's cards next to Text A's: a changed decision is marked on both, and each of B's bars says
  // how many points it moved from A's (A's rows get an empty cell, so that the columns line up)
  const [first, second] = panels.map((panel) => [...panel.querySelectorAll(".field")]);
  for (const panel of panels) panel.classList.add("compared");
  for (const card of second) {
    const other = first.find((candidate) => candidate.dataset.field === card.dataset.field);
    if (!other) continue;
    if (other.dataset.decision !== card.dataset.decision) {
      for (const changed of [card, other]) {
        changed.classList.add("changed");
        changed.querySelector(".flags").append(flag("decision differs from the other text", "alert"));
      }
    }
    for (const row of card.querySelectorAll(".bar")) {
      const before = [...other.querySelectorAll(".bar")].find((candidate) => candidate.dataset.label === row.dataset.label);
      if (!before) continue;
      const points = 100 * (Number(row.dataset.probability) - Number(before.dataset.probability));
      const shownPoints = points.toFixed(1);
      row.append(element("span", "delta", shownPoints.startsWith("-") ? shownPoints : `+${shownPoints}`));
      before.append(element("span", "delta", ""));
    }
  }
}

// -- the page -------------------------------------------------------------------------------------
function showLocalError(message) {
  const panel = element("div", "error");
  panel.dataset.status = "local";
  panel.append(element("h2", "", "Not sent"), element("pre", "error-body", message));
  byId("results").replaceChildren(panel);
}

// the editor's schema or question set; undefined (said on the page) when it is not JSON
function readSpec() {
  try {
    return JSON.parse(byId("spec").value);
  } catch (error) {
    showLocalError(`The schema or question set is not valid JSON: ${error.message}`);
    return undefined;
  }
}

async function decide() {
  const spec = readSpec();
  if (spec === undefined) return finish();
  const comparing = byId("compare").checked;
  const texts = comparing ? [["Text A", byId("text-a").value], ["Text B", byId("text-b").value]] : [["Text", byId("text-a").value]];
  byId("decide").disabled = true;
  byId("busy").hidden = false;
  const panels = [];
  try {
    for (const [title, text] of texts) {
      const call = request(spec, text);
      const answer = await post(call.path, call.body);
      panels.push(resultPanel(title, answer, call));
      if (answer.status === 401) byId("key-form").hidden = false;
    }
    if (panels.length === 2 && panels.every((panel) => panel.classList.contains("result"))) compareResults(panels);
    byId("results").replaceChildren(...panels);
  } finally {
    byId("decide").disabled = false;
    byId("busy").hidden = true;
    finish();
  }
}

function finish() {
  state.runs += 1;
  byId("results").dataset.runs = String(state.runs); // what a test waits on
}

function loadExample() {
  const example = state.examples[Number(byId("example").value)];
  if (!example) return;
  byId("spec").value = JSON.stringify(example.spec, null, 2);
  byId("text-a").value = example.text;
}

async function readHealth() {
  try {
    const health = await (await fetch("/healthz")).json();
    state.model = health.model || state.model;
    const status = health.status === "ready" ? "" : ` (${health.status}${health.error ? `: ${health.error}` : ""})`;
    byId("model").textContent = `model: ${health.model || "unknown"}${status}`;
    if (health.status === "loading") setTimeout(readHealth, 1000);
  } catch (error) {
    byId("model").textContent = `the server did not answer /healthz: ${error}`;
  }
}

async function start() {
  byId("decide").addEventListener("click", decide);
  byId("load-example").addEventListener("click", loadExample);
  byId("compare").addEventListener("change", () => {
    byId("text-b-column").hidden = !byId("compare").checked;
  });
  byId("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.apiKey = byId("api-key").value;
    sessionStorage.setItem(KEY_STORAGE, state.apiKey);
    byId("key-state").textContent = state.apiKey ? "key set for this tab" : "no key";
  });
  if (state.apiKey) byId("key-state").textContent = "key set for this tab";
  await readHealth();
  const bundled = await (await fetch("/playground/examples")).json();
  state.examples = bundled.examples;
  state.conversationExample = bundled.conversation;
  byId("conversation-example").textContent = `Example: ${bundled.conversation.name}`;
  byId("key-form").hidden = !bundled.api_key_required;
  state.examples.forEach((example, index) => byId("example").append(new Option(example.name, String(index))));
  loadExample();
  document.body.dataset.ready = "true";
}

document.addEventListener("DOMContentLoaded", start);
