"""frontend/reasoning: qwen3, glm45, deepseek_r1 and minimax_m2 split `<think>` reasoning
from the answer (minimax_m2_append_think keeps it all as content; ernie45 unwraps the
answer from `<response>` tags).
The reference is the expected results written by hand below (vLLM's rules: the text
before `</think>` is reasoning, a missing start tag is fine, a missing end tag makes the
output all reasoning, qwen3 with thinking disabled all content); streaming is checked
against the whole-output result for random splits."""

from __future__ import annotations

import random

import pytest

from pagellm.frontend.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Ernie45ReasoningParser,
    GptOssReasoningParser,
    MiniMaxM2AppendThinkReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    SeedOssReasoningParser,
    ThinkTagReasoningParser,
    get_reasoning_parser,
)
from pagellm.protocol.reasoning import REASONING_TAGS

# (text, reasoning_content, content): the same for both parsers with thinking enabled
THINK_CASES: list[tuple[str, str | None, str | None]] = [
    ("<think>\nI should add.\n</think>\n\nThe answer is 4.", "\nI should add.\n",
     "\n\nThe answer is 4."),
    # the start tag in the prompt: only the end tag is generated
    ("I should add.</think>4", "I should add.", "4"),
    # no end tag: cut off mid-thought, all reasoning
    ("still thinking", "still thinking", None),
    ("<think>abc", "abc", None),
    ("abc</thi", "abc</thi", None),
    ("<thi", "<thi", None),
    ("<think></think>answer", None, "answer"),
    ("reason</think>", "reason", None),
    ("</think>", None, None),
    ("", None, None),
    # only the first start tag before the end tag is removed; text before it is kept
    ("pre<think>mid</think>post", "premid", "post"),
    ("<think>a<think>b</think>c", "a<think>b", "c"),
    # tags in the answer stay in the answer
    ("a</think>b<think>c</think>d", "a", "b<think>c</think>d"),
    ("</think></think>", None, "</think>"),
    ("<</think>>", "<", ">"),
    ("</<think>think>x", "</think>x", None),
    ("思考 🤔</think>答え", "思考 🤔", "答え"),
]

# the parsers of `<think>` tags that keep the answer as written (Seed-OSS's: SEED_CASES;
# ERNIE 4.5's, which unwraps it: ERNIE_CASES; gpt-oss's Harmony parser: test_harmony.py)
PARSERS = sorted(name for name, parser_class in REASONING_PARSERS.items()
                 if issubclass(parser_class, ThinkTagReasoningParser)
                 and REASONING_TAGS[name] == ("<think>", "</think>") and name != "ernie45")
# ERNIE 4.5: the think-tag rule, then the answer unwrapped (newlines after the end tag
# dropped; a `<response>` opening it dropped, the answer ending at `</response>`)
ERNIE_CASES: list[tuple[str, str | None, str | None]] = [
    ("abc\n</think>\n\n<response>\ndef\n</response>\n", "abc\n", "\ndef\n"),
    ("abc\n</think>\ndef", "abc\n", "def"),
    ("<think>plan</think><response>4</response>", "plan", "4"),
    ("plan</think>\n\n<response>cut off", "plan", "cut off"),
    ("plan</think>\n\n<resp", "plan", "<resp"),
    ("plan</think>\n\n", "plan", None),
    ("plan</think>\nsee <response> here</response>", "plan", "see <response> here</response>"),
    ("plan</think><response>a</response>b<response>c</response>", "plan", "a"),
    ("plan</think><response>a</respon", "plan", "a</respon"),
    ("still thinking", "still thinking", None),
]
# Seed-OSS: its own tags; Qwen's are text to it; the budget reflections are reasoning
SEED_CASES: list[tuple[str, str | None, str | None]] = [
    ("<seed:think>Plan it.</seed:think>The answer.", "Plan it.", "The answer."),
    ("<seed:think>a<seed:cot_budget_reflect>used 9 of 512</seed:cot_budget_reflect>b",
     "a<seed:cot_budget_reflect>used 9 of 512</seed:cot_budget_reflect>b", None),
    ("<think>x</think> then</seed:think>y", "<think>x</think> then", "y"),
    ("no tags", "no tags", None),
    ("</seed:thi", "</seed:thi", None),
]


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize(("text", "reasoning", "content"), THINK_CASES)
def test_extract_reasoning(name: str, text: str, reasoning: str | None,
                           content: str | None) -> None:
    assert get_reasoning_parser(name)().extract_reasoning(text) == (reasoning, content)


def test_qwen3_with_thinking_disabled_is_all_content() -> None:
    parser = Qwen3ReasoningParser(thinking_enabled=False)
    assert parser.reasoning_ended
    assert parser.extract_reasoning("The answer is 4.") == (None, "The answer is 4.")
    assert parser.extract_reasoning("x</think>y") == (None, "x</think>y")
    assert parser.extract_reasoning("") == (None, None)
    assert parser.feed("x</thi") == {"content": "x</thi"}
    assert parser.feed("") is None
    assert parser.finish() is None


def test_deepseek_r1_always_thinks_first() -> None:
    parser = DeepSeekR1ReasoningParser(thinking_enabled=False)  # no switch in R1
    assert parser.extract_reasoning("no end tag") == ("no end tag", None)
    assert not parser.reasoning_ended


def _stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str, bool]:
    """The reasoning and the content joined, and reasoning_ended at the end, checking
    every delta's shape."""
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish())
    reasoning = content = ""
    for delta in deltas:
        if delta is None:
            continue
        assert delta and set(delta) <= {"reasoning_content", "content"}, delta
        assert all(isinstance(v, str) and v for v in delta.values()), delta
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
    return reasoning, content, parser.reasoning_ended


def _random_pieces(text: str, rng: random.Random) -> list[str]:
    pieces = []
    pos = 0
    while pos < len(text):
        size = rng.choice([0, 1, 1, 2, 3, 5, 8])
        pieces.append(text[pos:pos + size])
        pos += size
    return pieces


@pytest.mark.parametrize("thinking_enabled", [True, False])
@pytest.mark.parametrize("name", PARSERS)
def test_streaming_equals_extract_for_random_splits(name: str, thinking_enabled: bool) -> None:
    rng = random.Random(0)
    parser_class = get_reasoning_parser(name)
    for text, _, _ in THINK_CASES:
        expected = parser_class(thinking_enabled=thinking_enabled).extract_reasoning(text)
        splits = [[text], list(text)] + [_random_pieces(text, rng) for _ in range(30)]
        for pieces in splits:
            parser = parser_class(thinking_enabled=thinking_enabled)
            reasoning, content, ended = _stream(parser, pieces)
            assert (reasoning or None, content or None) == expected, (text, pieces)
            thinks = thinking_enabled or name not in ("qwen3", "glm45")  # their switch
            assert ended == (not thinks or "</think>" in text), (text, pieces)


def test_streaming_holds_back_only_a_possible_tag() -> None:
    parser = Qwen3ReasoningParser()
    assert parser.feed("<think>") is None
    assert parser.feed("Let me think <") == {"reasoning_content": "Let me think "}
    assert parser.feed("b> about it </thi") == {"reasoning_content": "<b> about it "}
    assert not parser.reasoning_ended
    assert parser.feed("nk>\n\nFour") == {"content": "\n\nFour"}
    assert parser.reasoning_ended
    assert parser.feed(".") == {"content": "."}
    assert parser.finish() is None

    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("Thinking</think") == {"reasoning_content": "Thinking"}
    assert parser.finish() == {"reasoning_content": "</think"}
    assert not parser.reasoning_ended

    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("a</think>b") == {"reasoning_content": "a", "content": "b"}
    assert parser.reasoning_ended


@pytest.mark.parametrize(("text", "reasoning", "content"), SEED_CASES)
def test_seed_oss_splits_at_its_own_tags(text: str, reasoning: str | None,
                                         content: str | None) -> None:
    assert SeedOssReasoningParser().extract_reasoning(text) == (reasoning, content)
    rng = random.Random(1)
    for pieces in [[text], list(text)] + [_random_pieces(text, rng) for _ in range(20)]:
        streamed, shown, ended = _stream(SeedOssReasoningParser(), pieces)
        assert (streamed or None, shown or None) == (reasoning, content), pieces
        assert ended == ("</seed:think>" in text)


@pytest.mark.parametrize(("text", "reasoning", "content"), ERNIE_CASES)
def test_ernie45_unwraps_the_answer_whole_and_streamed(text: str, reasoning: str | None,
                                                      content: str | None) -> None:
    assert Ernie45ReasoningParser().extract_reasoning(text) == (reasoning, content)
    rng = random.Random(2)
    for pieces in [[text], list(text)] + [_random_pieces(text, rng) for _ in range(40)]:
        streamed, shown, ended = _stream(Ernie45ReasoningParser(), pieces)
        assert (streamed or None, shown or None) == (reasoning, content), pieces
        assert ended == ("</think>" in text)


def test_ernie45_streaming_equals_extract_for_generated_texts() -> None:
    """Texts glued from whole and partial think and response tags and newlines (fixed
    seed), streamed in random pieces: the same split as the whole text's."""
    fragments = ["</think>", "<response>", "</response>", "<resp", "</resp", "<", ">",
                 "\n", "\n", "a", " "]
    rng = random.Random(3)
    for _ in range(2000):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 10)))
        expected = Ernie45ReasoningParser().extract_reasoning(text)
        reasoning, content, _ = _stream(Ernie45ReasoningParser(), _random_pieces(text, rng))
        assert (reasoning or None, content or None) == expected, text


def test_registry_matches_the_protocol_tag_table() -> None:
    assert set(REASONING_PARSERS) == set(REASONING_TAGS)
    assert PARSERS == ["deepseek_r1", "glm45", "minimax_m2", "qwen3"]
    assert REASONING_PARSERS["openai_gptoss"] is GptOssReasoningParser
    seed = REASONING_PARSERS["seed_oss"]()
    assert isinstance(seed, SeedOssReasoningParser)
    assert (seed.start_tag, seed.end_tag) == REASONING_TAGS["seed_oss"]
    for name, parser_class in REASONING_PARSERS.items():
        assert get_reasoning_parser(name) is parser_class
    for name in PARSERS:
        parser = REASONING_PARSERS[name]()
        assert (parser.start_tag, parser.end_tag) == REASONING_TAGS[name]
    with pytest.raises(ValueError,
                       match=r"deepseek_r1.*ernie45.*glm45.*minimax_m2.*minimax_m2_append_think"
                             r".*openai_gptoss.*qwen3.*seed_oss"):
        get_reasoning_parser("granite")


@pytest.mark.parametrize("thinking_enabled", [True, False])
@pytest.mark.parametrize("name", PARSERS)
def test_streaming_equals_extract_for_generated_texts(name: str, thinking_enabled: bool) -> None:
    """Texts glued from whole and partial tags (fixed seed), streamed in random pieces."""
    fragments = ["<think>", "</think>", "<", "/", "think", ">", "</thi", "<th", "a", " ", "\n"]
    rng = random.Random(0)
    parser_class = get_reasoning_parser(name)
    for _ in range(2000):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 10)))
        expected = parser_class(thinking_enabled=thinking_enabled).extract_reasoning(text)
        reasoning, content, _ = _stream(parser_class(thinking_enabled=thinking_enabled),
                                        _random_pieces(text, rng))
        assert (reasoning or None, content or None) == expected, text


def test_minimax_m2_append_think_keeps_the_thinking_in_the_content() -> None:
    """vLLM's minimax_m2_append_think: the whole output is content, `<think>` put back
    in front (the model's template opened none in the prompt), whole and streamed; the
    reasoning has ended when the last think tag written is `</think>` (where a grammar
    or a tool parser takes over)."""
    text = "Plan it.\n</think>\n\nThe answer."
    parser = MiniMaxM2AppendThinkReasoningParser()
    assert parser.extract_reasoning(text) == (None, "<think>" + text)
    assert parser.extract_reasoning("") == (None, "<think>")
    assert parser.feed("Plan it.\n</th") == {"content": "<think>Plan it.\n</th"}
    assert not parser.reasoning_ended
    assert parser.feed("ink>\n\nThe answer.") == {"content": "ink>\n\nThe answer."}
    assert parser.reasoning_ended
    assert parser.feed("") is None and parser.finish() is None
    empty = MiniMaxM2AppendThinkReasoningParser()
    assert empty.finish() == {"content": "<think>"} and empty.finish() is None
    rng = random.Random(2)
    for text in [t for t, _, _ in THINK_CASES]:
        for pieces in [[text], list(text)] + [_random_pieces(text, rng) for _ in range(20)]:
            reasoning, content, ended = _stream(MiniMaxM2AppendThinkReasoningParser(), pieces)
            assert (reasoning, content) == ("", "<think>" + text), pieces
            last_start, last_end = text.rfind("<think>"), text.rfind("</think>")
            assert ended == (last_end > last_start), (text, pieces)
