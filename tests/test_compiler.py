"""Prompt rendering, layouts and tokenization: on the real tokenizers and on crafted ones."""

import pytest

from pcd_core import PromptError, TokenizationError, parse_schema
from pcd_core.prompting.compiler import compile_schema
from pcd_core.prompting.prompt import MARKER, render
from pcd_core.testing import ByteTokenizer, _ByteVocabulary
from pcd_core.tokenizer import LAYOUTS, TextTokenizer

SCHEMA = parse_schema(
    {"sentiment": ["POSITIVE", "NEGATIVE"], "refund": "boolean", "deadline": ["1_HOUR", "12_HOURS", "1_WEEK", "NONE"]}
)


class _Templater:
    """A chat template stand-in: renders messages, optionally rejecting the system role."""

    chat_template = "stand-in"

    def __init__(self, reject_system=False, copies=1):
        self.reject_system, self.copies = reject_system, copies

    def apply_chat_template(self, messages, **kwargs):
        assert kwargs["enable_thinking"] is False and kwargs["add_generation_prompt"] is True
        if self.reject_system and any(m["role"] == "system" for m in messages):
            raise ValueError("System role not supported")
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"
        return text.replace(MARKER, MARKER * self.copies)


def test_chat_template_puts_the_catalog_in_the_system_turn():
    parts = render(_Templater(), "SYSTEM", "Input:\n", "{")
    assert parts.layout == "chat"
    assert parts.head == "<system>SYSTEM</system><user>Input:\n"
    assert parts.tail == "</user><assistant>{"


def test_a_template_rejecting_the_system_role_gets_it_merged_into_the_user_turn():
    parts = render(_Templater(reject_system=True), "SYSTEM", "Input:\n", "{")
    assert parts.layout == "chat-merged-system"
    assert parts.head.startswith("<user>SYSTEM\n\nInput:\n")


def test_no_template_gives_the_plain_layout():
    parts = render(ByteTokenizer(), "SYSTEM", "Input:\n", "{")
    assert parts.layout == "plain" and parts.head.startswith("SYSTEM")


@pytest.mark.parametrize("copies", [0, 2])
def test_a_template_that_drops_or_repeats_the_input_is_a_prompt_error(copies):
    with pytest.raises(PromptError, match="copies of the input slot"):
        render(_Templater(copies=copies), "SYSTEM", "Input:\n", "{")


def test_catalog_lists_every_allowed_value():
    compiled = compile_schema(SCHEMA, ByteTokenizer())
    assert '- "deadline": Allowed: "1_HOUR" | "12_HOURS" | "1_WEEK" | "NONE"' in compiled.prompt.head
    assert '- "refund": Allowed: true | false' in compiled.prompt.head


def test_empty_input_is_a_prompt_error():
    compiled = compile_schema(SCHEMA, ByteTokenizer())
    with pytest.raises(PromptError, match="empty"):
        compiled.prompt.request_text("   \n")


class _MergingVocabulary(_ByteVocabulary):
    """Bytes, except that each string in ``merges`` is always one token: seams that re-tokenize."""

    def __init__(self, *merges):
        self.merges = [m.encode() for m in merges]

    def encode(self, text, add_special_tokens=False):
        data, ids, i = text.encode(), [], 0
        while i < len(data):
            hit = next((k for k, m in enumerate(self.merges) if data.startswith(m, i)), None)
            if hit is None:
                ids.append(data[i])
                i += 1
            else:
                ids.append(300 + hit)
                i += len(self.merges[hit])
        return ids


@pytest.mark.parametrize("merge, layout", [("{\n", "newline-before"), ("\n ", "newline-after")])
def test_the_layout_is_the_one_whose_seams_do_not_merge(merge, layout):
    assert compile_schema(SCHEMA, TextTokenizer(_MergingVocabulary(merge))).layout.name == layout


def test_a_line_no_layout_can_cut_raises_tokenization_error_naming_the_field():
    with pytest.raises(TokenizationError) as caught:
        compile_schema(SCHEMA, TextTokenizer(_MergingVocabulary("{\n", "\n ")))
    assert caught.value.field == "sentiment"


def test_labels_that_tokenize_identically_are_rejected():
    with pytest.raises(TokenizationError, match="same ids"):
        compile_schema(parse_schema({"properties": {"n": {"enum": ["3", 3]}}}), ByteTokenizer())


def test_smollm2_glues_the_newline_to_the_indentation_after(engine):
    compiled = engine.compile({"a": ["X", "Y"], "b": "boolean"})
    assert compiled.layout.name == "newline-after"
    assert compiled.prompt.layout == "chat"
    first_token = engine.tokenizer.decode(compiled.field("b").variants[0].ids[:1])
    assert first_token == "\n "


def test_booleans_end_the_row_at_the_colon_so_the_value_keeps_its_space(engine):
    compiled = engine.compile({"a": ["X", "Y"], "flag": "boolean"})
    trie = compiled.field("flag").trie
    assert engine.tokenizer.decode(trie.row).endswith('"flag":')
    spelled = {engine.tokenizer.decode([t]) for t in trie.root.children}
    assert spelled == {" true", " false", ' "'}


def test_every_layout_has_clean_seams_on_gemma(gemma_engine):
    compiled = gemma_engine.compile(SCHEMA)
    assert compiled.layout in LAYOUTS
    assert compiled.prompt.layout == "plain"


def test_a_line_that_merges_with_the_text_after_it_raises_tokenization_error():
    with pytest.raises(TokenizationError, match="text after it") as caught:
        compile_schema(SCHEMA, TextTokenizer(_MergingVocabulary(",\n", "\n ")))
    assert caught.value.field == "sentiment"


def test_the_state_close_is_read_in_the_trunk_so_a_merging_fence_end_is_asked_and_a_merging_question_refused():
    # Qwen's tokenizer reads the fence's closing ">>>" and the line breaks after it as one token
    from pcd_core.planning.deciding import plan_decide
    from pcd_core.prompting.question_rows import STATE_CLOSE, as_text, ask, question_block, render_decide_prompt
    from pcd_core.request.questions import DecideRequest, NoulQuestion

    tokenizer = TextTokenizer(_MergingVocabulary(">\n\n"))
    prompt = render_decide_prompt(tokenizer)
    question = NoulQuestion(instructions="Is it broken?")
    plan = plan_decide(tokenizer, prompt, DecideRequest(state="It broke.", questions={"q": question}), 4096)
    read = plan.whole + plan.asked[0].trie.variants[0].ids
    expected = tokenizer.encode_head(
        prompt.head + as_text("It broke.") + STATE_CLOSE + question_block(question, []) + prompt.tail
    )
    assert read[: len(expected)] == expected  # trunk and row: the prompt read in one piece
    merging = TextTokenizer(_MergingVocabulary("\nQ"))
    head = render_decide_prompt(merging).head
    with pytest.raises(TokenizationError, match="question's text merges") as caught:
        ask(merging, render_decide_prompt(merging), head + "It broke." + STATE_CLOSE, question, "q")
    assert caught.value.field == "q"


@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_each_models_tokenizer_asks_every_kind_of_question_after_any_state(alias):
    # Qwen's tokenizer refused every decide before the state close moved into the trunk
    from pcd_core.errors import PcdError
    from pcd_core.loading.dummy_weights import dummy_tokenizer
    from pcd_core.planning.deciding import plan_decide
    from pcd_core.prompting.question_rows import render_decide_prompt
    from pcd_core.request.questions import ChoiceQuestion, DecideRequest, NoulQuestion, ScoreQuestion

    try:
        tokenizer = dummy_tokenizer(alias)
    except PcdError as error:
        if alias.startswith("qwen"):  # an optional package; the two embedded models always run
            pytest.skip(str(error))
        raise
    prompt = render_decide_prompt(tokenizer)
    questions = {
        "broken": NoulQuestion(instructions="Is it broken?"),
        "by_criteria": NoulQuestion(criteria={"true": "it mentions a refund"}),
        "team": ChoiceQuestion(instructions="Which team?", criteria={"billing": None, "sales": "deals"}),
        "severity": ScoreQuestion(instructions="How bad?", criteria=["low", "high"]),
    }
    for state in ["It broke.", "Is it broken?", "ok!)", "Fine", "two\n\nlines.", {"order": 7}]:
        plan = plan_decide(tokenizer, prompt, DecideRequest(state=state, questions=questions), 8192)
        assert len(plan.asked) == len(questions)
        assert all(
            tokenizer.decode(a.trie.row).lstrip().startswith(("Question", "Options", "Answer")) for a in plan.asked
        )
