"""The playground page (``pcd_integrations/http/playground``) in a real headless browser against ``pcd serve``
on loopback with the embedded model.

The browser is Debian's ``chromium`` driven by Playwright (the dev extra); nothing downloads a browser
(``playwright install`` is never run), so a machine without chromium skips the browser tests and says
how to install it (``.ci/run`` does). Each test sends the page's request to the API itself and checks
what the page drew against that JSON: the value, one bar per allowed label whose printed percentage
and drawn width are the probability, the candidate mass with its mark at 0.5, the flags, warnings and
cost line, and a refused request's body exactly as the API returned it.

``PCD_PLAYGROUND_SCREENSHOT=docs/playground.png python -m pytest tests/test_playground.py -k bundled``
also writes the screenshot of docs/playground.md, from the same run that checks it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("uvicorn", reason="the HTTP server needs the 'http' extra")
httpx = pytest.importorskip("httpx", reason="the HTTP tests need httpx")
sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need 'playwright' (the dev extra)")

from loopback import serving  # noqa: E402

from pcd_core import Engine  # noqa: E402
from pcd_integrations.commands.main import main  # noqa: E402
from pcd_integrations.http import create_app  # noqa: E402
from pcd_integrations.http.playground import bundled_conversation, bundled_examples  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# no network, no GPU, nothing that phones home: the page must work on a machine that is offline
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1360, "height": 720}
DECIDE_TIMEOUT_MS = 180_000  # the embedded model on a 2-core CI machine; a fill takes a few seconds
API_KEY = "playground-test-key"
# the percentages are printed to 0.1 points: half of that for rounding, and as much again for the
# float noise between a request that built the schema's cached head and one that reused it
PERCENT_TOLERANCE = 0.1
# a drawn width is whole device pixels on a track about 100 px wide
WIDTH_TOLERANCE = 0.02
CALM_TEXT = "Hi team, love the new dashboard! Could you add a dark mode some day? No rush. I'm on the free plan."
ONE_OPTION = {"questions": {"team": {"type": "choice", "instructions": "Which team?", "criteria": {"returns": None}}}}
# a decided boolean, a multi-label list (one membership probability per label) and a generated string
MIXED = {
    "type": "object",
    "properties": {
        "urgent": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["billing", "refund", "bug"]}, "uniqueItems": True},
        "summary": {"type": "string", "maxLength": 30},
    },
    "required": ["urgent", "tags", "summary"],
}
TICKET, REFUND = bundled_examples()[:2]
CONVERSATION = bundled_conversation()
# the third turn is typed, not the example's: it asks for money back and threatens to leave
TYPED_TURN = {"role": "customer", "text": "Refund the double charge today or I cancel the whole plan."}
REFUND_ONLY = {"questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}


# -- what the page should draw, derived from the API's JSON here, independently of the page's script --
@dataclass(frozen=True)
class Expected:
    field: str
    value: str
    bars: tuple[tuple[str, float], ...]  # (label, probability) in the wire's order
    chosen: str
    mass: float
    debiased: bool
    calibrated: bool


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _argmax(probabilities: dict[str, float]) -> str:
    return max(probabilities, key=lambda label: probabilities[label])


def expected_from_chat(body: dict[str, Any]) -> list[Expected]:
    return expected_from_fields(body["x_pcd"]["fields"])


def expected_from_fields(fields: dict[str, Any]) -> list[Expected]:
    """A fill's decided fields (``FieldResult.to_dict()``, as ``x_pcd.fields`` and a session's record carry them)."""
    return [
        Expected(
            name,
            _shown(field["value"]),
            tuple(field["probabilities"].items()),
            _argmax(field["probabilities"]),
            field["candidate_mass"],
            field["debiased"],
            field["calibrated"],
        )
        for name, field in fields.items()
    ]


def expected_from_systemone(body: dict[str, Any]) -> list[Expected]:
    expected = []
    for name, answer in body["answers"].items():
        if answer["type"] == "noul":
            yes = "true" if answer["noul"] >= 0.5 else "false"
            value, bars = f"{yes} (P(yes) {answer['noul']:.3f})", {"true": answer["noul"], "false": 1 - answer["noul"]}
            chosen = yes
        else:
            bars = answer["probabilities"]
            value = answer["choice"] if answer["type"] == "choice" else f"score {answer['score']:.2f}"
            chosen = answer["choice"] if answer["type"] == "choice" else _argmax(bars)
        mass, debiased, calibrated = answer["x_candidate_mass"], answer["x_debiased"], answer["x_calibrated"]
        expected.append(Expected(name, value, tuple(bars.items()), chosen, mass, debiased, calibrated))
    return expected


def api_request(spec: dict[str, Any], text: str, model: str) -> tuple[str, dict[str, Any]]:
    """The route and body the page sends for ``spec`` (a question set or a JSON Schema) and ``text``."""
    if "questions" in spec:
        return "/v1/systemone", {"state": text, "questions": spec["questions"], "model": model}
    schema_format = {"name": "example", "schema": spec}  # the name changes nothing in a fill
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    return "/v1/chat/completions", {**body, "response_format": {"type": "json_schema", "json_schema": schema_format}}


def ask_api(base_url: str, spec: dict[str, Any], text: str, model: str, key: str | None = None) -> httpx.Response:
    path, body = api_request(spec, text, model)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(base_url + path, json=body, headers=headers, timeout=DECIDE_TIMEOUT_MS / 1000)


# -- reading the page ---------------------------------------------------------------------------
READ_PANELS = """() => [...document.querySelectorAll('#results > *')].map((panel) => {
  const box = (node) => { const r = node.getBoundingClientRect(); return {x: r.x, width: r.width}; };
  const bar = (row) => ({
    label: row.dataset.label, shown: row.querySelector('.bar-label').textContent,
    text: row.querySelector('.percent').textContent, chosen: row.classList.contains('chosen'),
    fill: box(row.querySelector('.fill')).width, track: box(row.querySelector('.track')),
    mark: row.querySelector('.half-mark') && box(row.querySelector('.half-mark')),
    delta: row.querySelector('.delta') && row.querySelector('.delta').textContent,
  });
  return {
    kind: panel.classList[0], compared: panel.classList.contains('compared'), status: panel.dataset.status || null, title: panel.querySelector('h2').textContent,
    cost: panel.querySelector('.cost') && panel.querySelector('.cost').textContent,
    warnings: [...panel.querySelectorAll('.warnings li')].map((li) => li.textContent),
    error: panel.querySelector('.error-body') && panel.querySelector('.error-body').textContent,
    cards: [...panel.querySelectorAll('.field')].map((card) => ({
      field: card.dataset.field, value: card.querySelector('.value').textContent,
      changed: card.classList.contains('changed'),
      moved: card.querySelector('.moved') && card.querySelector('.moved').textContent,
      flags: [...card.querySelectorAll('.flag')].map((flag) => flag.textContent),
      bars: [...card.querySelectorAll('.bars .bar')].map(bar),
      mass: card.querySelector('.bar.mass') && bar(card.querySelector('.bar.mass')),
    })),
  };
})"""


READ_CONVERSATION = """() => [...document.querySelectorAll('#conversation .turn')].map((item) => ({
  role: item.querySelector('.turn-role').textContent, text: item.querySelector('.turn-text').textContent,
}))"""


def press(page: Any, button: str) -> list[dict[str, Any]]:
    """Press ``button``, wait until the page has drawn what came back, and read every panel."""
    runs = int(page.get_attribute("#results", "data-runs") or 0)
    page.click(button)
    page.wait_for_selector(f"#results[data-runs='{runs + 1}']", timeout=DECIDE_TIMEOUT_MS)
    return list(page.evaluate(READ_PANELS))


def decide(page: Any) -> list[dict[str, Any]]:
    return press(page, "#decide")


def assert_bar(drawn: dict[str, Any], label: str, probability: float) -> None:
    assert drawn["label"] == label
    printed = float(drawn["text"].removesuffix("%"))
    assert abs(printed - 100 * probability) <= PERCENT_TOLERANCE, (label, drawn["text"], probability)
    assert abs(drawn["fill"] / drawn["track"]["width"] - probability) <= WIDTH_TOLERANCE, (label, drawn, probability)


def assert_cards_match(cards: list[dict[str, Any]], expected: list[Expected]) -> None:
    assert [card["field"] for card in cards] == [e.field for e in expected]
    for card, want in zip(cards, expected, strict=True):
        assert card["value"] == want.value
        for drawn, (label, probability) in zip(card["bars"], want.bars, strict=True):
            assert_bar(drawn, label, probability)
        assert [bar["label"] for bar in card["bars"] if bar["chosen"]] == [want.chosen]
        assert_bar(card["mass"], "candidate_mass", want.mass)
        track, mark = card["mass"]["track"], card["mass"]["mark"]
        assert abs(mark["x"] + mark["width"] / 2 - (track["x"] + track["width"] / 2)) <= 1.0  # the mark is at 0.5
        assert ("candidate mass below 0.5" in card["flags"]) == (want.mass < 0.5)
        assert ("debiased" if want.debiased else "not debiased") in card["flags"]
        assert ("calibrated" if want.calibrated else "not calibrated") in card["flags"]


def assert_panel_matches(panel: dict[str, Any], body: dict[str, Any], expected: list[Expected]) -> None:
    """Every decision the API returned is drawn as the API returned it, in its order, and nothing else."""
    assert panel["kind"] == "result", panel
    assert_cards_match(panel["cards"], expected)
    pcd = body.get("x_pcd", {})
    warnings = body["x_warnings"] if "x_warnings" in body else pcd["warnings"]
    passes = body["x_forward_passes"] if "x_forward_passes" in body else pcd["forward_passes"]
    tokens = body["usage"].get("input_tokens", body["usage"].get("prompt_tokens"))
    assert panel["warnings"] == warnings
    assert f"{passes} forward passes" in panel["cost"] and f"{tokens} tokens in" in panel["cost"], panel["cost"]
    assert "queue " in panel["cost"] and "round trip " in panel["cost"]


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine: apt-get install -y chromium (.ci/run installs it)")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def base_url(engine: Engine) -> Iterator[str]:
    with serving(create_app(engine)) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_url(engine: Engine) -> Iterator[str]:
    with serving(create_app(engine, api_key=API_KEY)) as url:
        yield url


@dataclass
class Opened:
    page: Any
    requested: list[str]  # every URL the page asked for
    problems: list[str]  # script errors and console errors the page logged


@contextmanager
def open_page(browser: Any, url: str) -> Iterator[Opened]:
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    opened = Opened(page, [], [])
    page.on("request", lambda request: opened.requested.append(request.url))
    page.on("pageerror", lambda error: opened.problems.append(str(error)))
    page.on("console", lambda message: message.type == "error" and opened.problems.append(message.text))
    page.goto(url + "/playground")
    page.wait_for_selector("body[data-ready='true']")
    yield opened
    context.close()


@pytest.fixture
def opened(browser: Any, base_url: str) -> Iterator[Opened]:
    with open_page(browser, base_url) as page:
        yield page


def load_example(page: Any, name: str) -> None:
    page.select_option("#example", label=name)
    page.click("#load-example")


# -- the tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("example", [TICKET, REFUND], ids=["schema", "question-set"])
def test_bundled_example_is_drawn_as_the_api_answers_it(
    opened: Opened, base_url: str, engine: Engine, example: dict[str, Any], tmp_path: Path
) -> None:
    page = opened.page
    load_example(page, example["name"])
    assert json.loads(page.input_value("#spec")) == example["spec"]
    assert page.input_value("#text-a") == example["text"]
    ask_api(base_url, example["spec"], example["text"], engine.model_name).raise_for_status()  # warm the head cache
    (panel,) = decide(page)
    body = ask_api(base_url, example["spec"], example["text"], engine.model_name).json()
    read = expected_from_systemone if example["kind"] == "questions" else expected_from_chat
    assert_panel_matches(panel, body, read(body))
    # everything came from this server (no CDN), and the page logged no error
    assert opened.requested and all(url.startswith(base_url + "/") for url in opened.requested), opened.requested
    assert not opened.problems
    shot = tmp_path / "playground.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000  # a drawn page, not a blank one
    readme_shot = os.environ.get("PCD_PLAYGROUND_SCREENSHOT")
    if readme_shot and example is TICKET:
        page.screenshot(path=readme_shot, full_page=True)


def test_a_refused_question_set_shows_the_422_body_the_api_returns(
    opened: Opened, base_url: str, engine: Engine, tmp_path: Path
) -> None:
    page = opened.page
    page.fill("#spec", json.dumps(ONE_OPTION))
    (panel,) = decide(page)
    refused = ask_api(base_url, ONE_OPTION, TICKET["text"], engine.model_name)
    assert refused.status_code == 422
    assert panel["kind"] == "error" and panel["status"] == "422" and "HTTP 422" in panel["title"]
    assert "/v1/systemone" in panel["title"]
    assert json.loads(panel["error"]) == refused.json()
    page.screenshot(path=str(tmp_path / "refused.png"), full_page=True)
    # a spec that is not JSON never leaves the page, and says so
    page.fill("#spec", '{"questions": ')
    (local,) = decide(page)
    assert local["status"] == "local" and "not valid JSON" in local["error"]


def test_compare_draws_both_texts_and_marks_the_decisions_that_differ(
    opened: Opened, base_url: str, engine: Engine
) -> None:
    page = opened.page
    load_example(page, REFUND["name"])
    page.check("#compare")
    page.fill("#text-b", CALM_TEXT)
    for text in (REFUND["text"], CALM_TEXT):  # the page's requests then find the caches warm, as the API's below do
        ask_api(base_url, REFUND["spec"], text, engine.model_name).raise_for_status()
    first, second = decide(page)
    bodies = [ask_api(base_url, REFUND["spec"], text, engine.model_name).json() for text in (REFUND["text"], CALM_TEXT)]
    for panel, body, title in zip((first, second), bodies, ("Text A", "Text B"), strict=True):
        assert panel["title"].startswith(title)
        assert_panel_matches(panel, body, expected_from_systemone(body))
    chosen = [{e.field: e.chosen for e in expected_from_systemone(body)} for body in bodies]
    differing = {field for field in chosen[0] if chosen[0][field] != chosen[1][field]}
    for panel in (first, second):
        assert {card["field"] for card in panel["cards"] if card["changed"]} == differing
    # each of B's bars says how many points it moved from A's; A's have the empty cell that aligns them
    expected = [{e.field: dict(e.bars) for e in expected_from_systemone(body)} for body in bodies]
    assert first["compared"] and second["compared"]
    masses = [{e.field: e.mass for e in expected_from_systemone(body)} for body in bodies]
    for card_a, card_b in zip(first["cards"], second["cards"], strict=True):
        assert all(bar["delta"] == "" for bar in [*card_a["bars"], card_a["mass"]])
        moved = 100 * (masses[1][card_b["field"]] - masses[0][card_a["field"]])
        assert abs(float(card_b["mass"]["delta"]) - moved) <= PERCENT_TOLERANCE
        for bar in card_b["bars"]:
            moved = 100 * (expected[1][card_b["field"]][bar["label"]] - expected[0][card_a["field"]][bar["label"]])
            assert abs(float(bar["delta"]) - moved) <= PERCENT_TOLERANCE, (card_b["field"], bar)


def test_with_an_api_key_the_page_asks_for_it_once_and_sends_it(browser: Any, keyed_url: str, engine: Engine) -> None:
    with open_page(browser, keyed_url) as opened:
        page = opened.page
        assert page.is_visible("#key-form")
        load_example(page, REFUND["name"])
        (refused,) = decide(page)
        assert refused["status"] == "401" and json.loads(refused["error"])["detail"]["error_type"] == "unauthorized"
        page.fill("#api-key", API_KEY)
        page.click("#key-form button")
        ask_api(keyed_url, REFUND["spec"], REFUND["text"], engine.model_name, key=API_KEY).raise_for_status()  # warm
        (panel,) = decide(page)
        body = ask_api(keyed_url, REFUND["spec"], REFUND["text"], engine.model_name, key=API_KEY).json()
        assert_panel_matches(panel, body, expected_from_systemone(body))
        page.reload()  # kept in the page for this tab: not typed again
        page.wait_for_selector("body[data-ready='true']")
        load_example(page, REFUND["name"])
        (again,) = decide(page)
        assert again["kind"] == "result"


def test_a_multi_label_list_and_a_generated_field_are_drawn_as_the_api_answers_them(
    opened: Opened, base_url: str, engine: Engine
) -> None:
    page = opened.page
    page.fill("#spec", json.dumps(MIXED))
    page.fill("#text-a", TICKET["text"])
    ask_api(base_url, MIXED, TICKET["text"], engine.model_name).raise_for_status()  # warm the head cache
    (panel,) = decide(page)
    fields = ask_api(base_url, MIXED, TICKET["text"], engine.model_name).json()["x_pcd"]["fields"]
    urgent, tags, summary = panel["cards"]
    assert [urgent["field"], tags["field"], summary["field"]] == ["urgent", "tags", "summary"]
    assert urgent["value"] == _shown(fields["urgent"]["value"]) and "not debiased" in urgent["flags"]
    # each label's own probability of belonging, and the list holds exactly those at 0.5 or more
    assert tags["value"] == json.dumps(fields["tags"]["value"], separators=(",", ":"))
    for drawn, (label, probability) in zip(tags["bars"], fields["tags"]["memberships"].items(), strict=True):
        assert_bar(drawn, label, probability)
        assert drawn["chosen"] == (label in fields["tags"]["value"])
    assert_bar(tags["mass"], "candidate_mass", fields["tags"]["candidate_mass"])
    # a generated value has no labels to draw, and no flags that would claim anything about it
    assert summary["value"] == fields["summary"]["value"] and summary["bars"] == [] and summary["mass"] is None
    assert summary["flags"] == []
    note = page.text_content("article[data-field='summary'] .note")
    assert note is not None and f"generated: {fields['summary']['n_tokens']} tokens" in note


def test_abstention_and_an_answer_set_are_drawn_when_the_response_carries_them(opened: Opened) -> None:
    """The ``x_abstained`` and ``x_answer_set`` are not returned yet: the server's real answer
    gets them added on its way to the page, which must show them rather than drop them.
    """
    page = opened.page
    added = {"x_abstained": True, "x_answer_set": ["returns", "product_safety"]}

    def with_issue_32_fields(route: Any) -> None:
        response = route.fetch()
        body = response.json()
        for answer in body["answers"].values():
            answer.update(added)
        route.fulfill(response=response, json=body)

    page.route("**/v1/systemone", with_issue_32_fields)
    team = {"team": REFUND["spec"]["questions"]["team"]}
    page.fill("#spec", json.dumps({"questions": team}))
    page.fill("#text-a", REFUND["text"])
    (panel,) = decide(page)
    (card,) = panel["cards"]
    assert "abstained" in card["flags"]
    shown_set = page.text_content("article[data-field='team'] .answer-set")
    assert shown_set == "answer set: {returns, product_safety}"


# -- conversation mode --------------------------------------------------------------------------
def read_session(base_url: str, sid: str) -> dict[str, Any]:
    reply = httpx.get(f"{base_url}/v1/sessions/{sid}", timeout=DECIDE_TIMEOUT_MS / 1000)
    reply.raise_for_status()
    return dict(reply.json())


def add_turn(page: Any, turn: dict[str, str] | None = None) -> dict[str, Any]:
    """Press Add turn (typing ``turn`` first, or with what the page offers), and read the one panel."""
    if turn is not None:
        page.select_option("#turn-role", turn["role"])
        page.fill("#turn-text", turn["text"])
    (panel,) = press(page, "#add-turn")
    return panel


def assert_moved(card: dict[str, Any], now: dict[str, float], before: dict[str, float]) -> None:
    """The marker under a field's head: the arrow of its top probability since the previous turn,
    that turn's percentage, and the label that was on top then when it is another.
    """
    top, was = _argmax(now), _argmax(before)
    arrow, direction, rest = card["moved"].split(" ", 2)
    printed = float(rest.split("%")[0].removeprefix("from "))
    assert abs(printed - 100 * before[was]) <= PERCENT_TOLERANCE, (card["field"], card["moved"], before)
    points = 100 * (now[top] - before[was])
    if abs(points) > PERCENT_TOLERANCE:  # nearer than that, the page may print the same percentage twice
        assert (arrow, direction) == (("▲", "up") if points > 0 else ("▼", "down")), (card["moved"], points)
    assert rest.endswith(f" (then {was})") == (was != top), (card["moved"], was, top)


def test_a_conversation_is_drawn_turn_by_turn_as_its_session_answers_it(
    opened: Opened, base_url: str, engine: Engine
) -> None:
    page = opened.page
    page.check("#mode-conversation")
    assert page.is_hidden("#decide") and page.is_visible("#add-turn")
    page.click("#load-conversation")
    assert json.loads(page.input_value("#spec")) == CONVERSATION["schema"]
    first, second = CONVERSATION["turns"][:2]
    sent: list[dict[str, str]] = []
    before: dict[str, dict[str, float]] = {}
    for turn in (None, None, TYPED_TURN):  # the example's first two turns as the page offers them, then a typed one
        offered = {"role": page.input_value("#turn-role"), "text": page.input_value("#turn-text")}
        sent.append(turn or offered)
        panel = add_turn(page, turn)
        sid = page.get_attribute("#session-state", "data-session")
        assert sid and page.get_attribute("#spec", "readonly") is not None  # the session's schema, fixed
        session = read_session(base_url, sid)
        assert session["kind"] == "fill" and session["turns"] == sent
        assert page.evaluate(READ_CONVERSATION) == sent
        record = session["result"]
        assert panel["kind"] == "result" and panel["title"] == f"Turn {len(sent)} · POST /v1/sessions/{sid}/turns"
        decided = {name: field for name, field in record["fields"].items() if "probabilities" in field}
        assert_cards_match([card for card in panel["cards"] if card["field"] in decided], expected_from_fields(decided))
        (summary,) = [card for card in panel["cards"] if card["field"] not in decided]
        assert summary["value"] == record["fields"]["summary"]["value"] and summary["moved"] is None
        assert panel["warnings"] == record["warnings"]
        # the append's own cost: the new turn's tokens read after the conversation's cached KV
        stats = record["stats"]
        assert f"{stats['forward_passes']} forward passes" in panel["cost"]
        assert f"this turn: {stats['prompt_tokens']} new tokens read" in panel["cost"], panel["cost"]
        assert f"{stats['cached_tokens']} cached" in panel["cost"] and "round trip " in panel["cost"]
        if len(sent) > 1:
            assert stats["cached_tokens"] > 0  # the earlier turns were not read again
        for card in panel["cards"]:
            if card["field"] in before:
                assert_moved(card, decided[card["field"]]["probabilities"], before[card["field"]])
            else:
                assert card["moved"] is None  # the first turn has nothing to move from
        before = {name: field["probabilities"] for name, field in decided.items()}
        if len(sent) == 1:  # the example's next turn is offered
            assert {"role": page.input_value("#turn-role"), "text": page.input_value("#turn-text")} == second
    assert sent[:2] == [first, second]
    assert not opened.problems
    shot = os.environ.get("PCD_PLAYGROUND_CONVERSATION_SCREENSHOT")
    if shot:
        page.screenshot(path=shot, full_page=True)
    # New conversation closes the session: its id is gone from the server, and the page starts over
    (closed,) = press(page, "#new-conversation")
    assert closed["kind"] == "closed" and f"DELETE /v1/sessions/{sid}" in closed["title"]
    assert httpx.get(f"{base_url}/v1/sessions/{sid}").status_code == 404
    assert page.evaluate(READ_CONVERSATION) == [] and page.get_attribute("#session-state", "data-session") == ""
    assert page.get_attribute("#spec", "readonly") is None
    # the one-text mode is as it was
    page.check("#mode-oneshot")
    assert page.is_visible("#decide") and page.is_hidden("#add-turn")


def test_a_refused_turn_shows_the_api_body_and_a_question_set_conversation_draws_its_answers(
    opened: Opened, base_url: str, engine: Engine
) -> None:
    page = opened.page
    page.check("#mode-conversation")
    page.fill("#spec", '{"questions": ')  # not JSON: no session is opened, and the page says why
    local = add_turn(page, {"role": "customer", "text": "hello"})
    assert local["status"] == "local" and "not valid JSON" in local["error"]
    assert page.get_attribute("#session-state", "data-session") == ""
    page.fill("#spec", json.dumps(REFUND_ONLY))
    blank = {"role": "customer", "text": ""}
    panel = add_turn(page, blank)
    sid = page.get_attribute("#session-state", "data-session")
    assert sid and read_session(base_url, sid)["turns"] == []  # opened, and the refused turn left it as it was
    own = httpx.post(f"{base_url}/v1/sessions", json={"questions": REFUND_ONLY["questions"]}).json()["id"]
    refused = httpx.post(f"{base_url}/v1/sessions/{own}/turns", json=blank)
    assert refused.status_code == 422 and httpx.delete(f"{base_url}/v1/sessions/{own}").status_code == 204
    assert panel["kind"] == "error" and panel["status"] == "422" and "HTTP 422" in panel["title"]
    assert f"POST /v1/sessions/{sid}/turns" in panel["title"]
    assert json.loads(panel["error"]) == refused.json()
    assert page.evaluate(READ_CONVERSATION) == []
    # the same session then takes a turn: a question set's answers, drawn by the one-text mode's code
    turn = {"role": "customer", "text": "I was charged twice. Please give me my money back."}
    panel = add_turn(page, turn)
    session = read_session(base_url, sid)
    assert session["kind"] == "decide" and session["turns"] == [turn]
    assert panel["title"] == f"Turn 1 · POST /v1/sessions/{sid}/turns"
    assert_panel_matches(panel, session["result"], expected_from_systemone(session["result"]))
    # the browser logs the refused request itself as a console error; nothing else went wrong
    assert [problem for problem in opened.problems if "status of 422" not in problem] == []


def test_the_bundled_conversation_is_the_examples_folders() -> None:
    full = json.loads((ROOT / "examples" / "support_conversation.json").read_text())
    assert CONVERSATION["schema"] == full["schema"]
    assert CONVERSATION["turns"] == full["turns"][: len(CONVERSATION["turns"])] and len(CONVERSATION["turns"]) >= 3


# -- without a browser ------------------------------------------------------------------------
def test_no_playground_leaves_the_page_routes_to_the_404_handler(engine: Engine) -> None:
    with serving(create_app(engine, playground=False)) as url:
        for path in ("/", "/playground", "/playground/examples", "/playground/static/playground.js"):
            missing = httpx.get(url + path)
            assert missing.status_code == 404 and missing.json()["detail"]["error_type"] == "not_found"
    with serving(create_app(engine)) as url:
        page = httpx.get(url + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert httpx.get(url + "/playground/static/../__init__.py").status_code == 404
        assert httpx.get(url + "/playground/static/__init__.py").status_code == 404
        assert "/" not in httpx.get(url + "/openapi.json").json()["paths"]


def test_pcd_serve_passes_no_playground_to_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    import pcd_integrations.http.app

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(pcd_integrations.http.app, "serve", lambda factory, **options: calls.append(options))
    assert main(["serve"]) == 0 and main(["serve", "--no-playground"]) == 0
    assert [call["playground"] for call in calls] == [True, False]


def test_the_bundled_ticket_is_the_examples_folders() -> None:
    assert TICKET["spec"] == json.loads((ROOT / "examples" / "ticket_schema.json").read_text())
    assert TICKET["text"] == (ROOT / "examples" / "ticket.txt").read_text()
