// The playground's conversation mode, beside playground.js (whose helpers it calls): the first turn
// opens a session (POST /v1/sessions) with the schema or question set in the editor, each "Add turn"
// appends one turn (POST /v1/sessions/{id}/turns) and draws the answer for the whole conversation with
// playground.js's resultPanel, and "New conversation" closes the session (DELETE /v1/sessions/{id}).
// Each field says how its top probability moved since the previous turn, and the cost line is the
// append's own: a session reads the new turn after the conversation's kept KV, not the whole text again.
"use strict";

const conversation = { id: null, kind: null, spec: "", turns: [], tops: null, example: [], next: 0 };
const stashed = { oneshot: [], conversation: [] }; // each mode's panels while the other mode is shown

function sessionBody(spec) {
  return isQuestionSet(spec) ? { questions: spec.questions } : { schema: spec };
}

// -- a turn's answer, read into playground.js's view -----------------------------------------------
function fromSessionTurn(body) {
  if ("answers" in body) return fromDecideTurn(body);
  const stats = body.stats;
  const cost = [
    `${stats.forward_passes} forward passes`,
    `this turn: ${stats.prompt_tokens} new tokens read`,
    `${stats.cached_tokens} cached (the conversation so far, not read again)`,
    `${stats.row_tokens} row tokens`,
    `${stats.output_tokens} out`,
    `queue ${stats.queue_ms.toFixed(1)} ms`,
  ];
  return { decisions: fillDecisions(body.fields), warnings: body.warnings || [], cost };
}

function fromDecideTurn(body) {
  // the System One body: its usage is every token the append read, the conversation's cached KV included
  const cost = [
    `${body.x_forward_passes} forward passes`,
    `${body.usage.input_tokens} tokens in (cached conversation included: the System One body does not split it)`,
    `queue ${body.x_queue_ms.toFixed(1)} ms`,
  ];
  return { decisions: systemOneDecisions(body.answers), warnings: body.x_warnings || [], cost };
}

// -- how each field's top probability moved since the previous turn --------------------------------
function topOf(card) {
  let top = null;
  for (const row of card.querySelectorAll(".bars .bar")) {
    const p = Number(row.dataset.probability);
    if (top === null || p > top.p) top = { label: row.dataset.label, p };
  }
  return top;
}

function topsOf(panel) {
  const tops = new Map();
  for (const card of panel.querySelectorAll(".field")) {
    const top = topOf(card);
    if (top) tops.set(card.dataset.field, top);
  }
  return tops;
}

function movedLine(now, before) {
  const same = percent(now.p) === percent(before.p);
  const direction = same ? "same" : now.p > before.p ? "up" : "down";
  const arrow = { same: "=", up: "▲", down: "▼" }[direction];
  const label = before.label === now.label ? "" : ` (then ${before.label})`;
  const line = element("div", `moved ${direction}`, `${arrow} ${direction} from ${percent(before.p)}${label}`);
  line.title = "the top probability at the previous turn";
  line.dataset.previous = String(before.p);
  line.dataset.previousLabel = before.label;
  return line;
}

function markMoves(panel, before) {
  if (!before) return;
  for (const card of panel.querySelectorAll(".field")) {
    const now = topOf(card);
    const then = before.get(card.dataset.field);
    if (now && then) card.querySelector(".field-head").after(movedLine(now, then));
  }
}

// -- the conversation -------------------------------------------------------------------------------
function drawConversation() {
  const items = conversation.turns.map((turn) => {
    const item = element("li", "turn");
    item.dataset.role = turn.role;
    item.append(element("span", "turn-role", turn.role), element("span", "turn-text", turn.text));
    return item;
  });
  byId("conversation").replaceChildren(...items);
  const open = conversation.id !== null;
  byId("session-state").textContent = open
    ? `Session ${conversation.id} (${conversation.kind}); its schema or question set is fixed until "New conversation".`
    : "No session yet: the first turn opens one with the schema or question set above.";
  byId("session-state").dataset.session = conversation.id || "";
  byId("spec").readOnly = open && state.mode === "conversation";
}

function setTurnBusy(busy) {
  for (const id of ["add-turn", "new-conversation", "load-conversation"]) byId(id).disabled = busy;
  byId("turn-busy").hidden = !busy;
}

function refused(answer) {
  if (answer.status === 401) byId("key-form").hidden = false;
  return !answer.ok;
}

async function openSession() {
  const spec = readSpec();
  if (spec === undefined) return false;
  const answer = await post("/v1/sessions", sessionBody(spec));
  if (refused(answer)) {
    byId("results").replaceChildren(errorPanel("Opening the session", answer, "/v1/sessions"));
    return false;
  }
  Object.assign(conversation, { id: answer.body.id, kind: answer.body.kind, spec: byId("spec").value });
  return true;
}

async function addTurn() {
  setTurnBusy(true);
  try {
    if (conversation.id === null && !(await openSession())) return;
    const turn = { role: byId("turn-role").value, text: byId("turn-text").value };
    const call = { path: `/v1/sessions/${conversation.id}/turns`, read: fromSessionTurn };
    const answer = await post(call.path, turn);
    const panel = resultPanel(`Turn ${conversation.turns.length + 1}`, answer, call);
    if (!refused(answer)) {
      markMoves(panel, conversation.tops);
      conversation.tops = topsOf(panel);
      conversation.turns.push(turn);
      offerExampleTurn();
    }
    byId("results").replaceChildren(panel);
  } finally {
    drawConversation();
    setTurnBusy(false);
    finish();
  }
}

function closedPanel(id, answer) {
  const path = `/v1/sessions/${id}`;
  if (refused(answer)) return errorPanel("Closing the session", answer, path, "DELETE");
  const panel = element("div", "closed");
  panel.append(element("h2", "", `Closed session ${id}: HTTP ${answer.status} from DELETE ${path}`));
  panel.append(element("p", "muted", "The next turn opens a new session with the schema or question set above."));
  return panel;
}

async function newConversation() {
  const id = conversation.id;
  Object.assign(conversation, { id: null, kind: null, spec: "", turns: [], tops: null });
  drawConversation();
  if (id === null) {
    byId("results").replaceChildren();
    return finish();
  }
  setTurnBusy(true);
  try {
    byId("results").replaceChildren(closedPanel(id, await send("DELETE", `/v1/sessions/${id}`)));
  } finally {
    setTurnBusy(false);
    finish();
  }
}

// -- the bundled example: its schema in the editor, its turns offered one "Add turn" at a time --------
function offerExampleTurn() {
  const turn = conversation.example[conversation.next];
  if (!turn) return;
  byId("turn-role").value = turn.role;
  byId("turn-text").value = turn.text;
  conversation.next += 1;
}

async function loadConversationExample() {
  const example = state.conversationExample;
  if (conversation.id !== null) await newConversation();
  byId("spec").value = JSON.stringify(example.schema, null, 2);
  Object.assign(conversation, { example: example.turns, next: 0 });
  offerExampleTurn();
}

function showMode() {
  const mode = byId("mode-conversation").checked ? "conversation" : "oneshot";
  const talking = mode === "conversation";
  if (mode === state.mode) return;
  stashed[state.mode] = [...byId("results").children];
  state.mode = mode;
  byId("results").replaceChildren(...stashed[mode]);
  for (const id of ["oneshot-inputs", "example-row"]) byId(id).hidden = talking;
  for (const id of ["conversation-inputs", "conversation-example-row"]) byId(id).hidden = !talking;
  // the editor holds the open session's spec in conversation mode, and is free in the other
  if (talking && conversation.id !== null) byId("spec").value = conversation.spec;
  byId("spec").readOnly = talking && conversation.id !== null;
}

function startConversation() {
  byId("mode-oneshot").addEventListener("change", showMode);
  byId("mode-conversation").addEventListener("change", showMode);
  byId("add-turn").addEventListener("click", addTurn);
  byId("new-conversation").addEventListener("click", newConversation);
  byId("load-conversation").addEventListener("click", loadConversationExample);
  drawConversation();
  showMode(); // a reload may bring the mode buttons back as they were
}

document.addEventListener("DOMContentLoaded", startConversation);
