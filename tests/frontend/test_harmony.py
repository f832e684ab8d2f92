"""gpt-oss's Harmony output as the chat API reports it: the openai_gptoss reasoning
parser, the two parsers together through chat_tools (one reading: reasoning, content
and calls), and which requests must keep special tokens in their text. The reference is
the Harmony format as OpenAI's documentation writes it (its examples, by hand below);
the openai tool parser's own cases are in test_tool_parsers.py with the other formats."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from test_reasoning_parsers import _stream
from test_tool_parsers import (
    HARMONY_CALL,
    HARMONY_FRAGMENTS,
    ROLE_CALL,
    THINK,
    _random_pieces,
    harmony,
)

from pagellm.frontend.reasoning import GptOssReasoningParser, get_reasoning_parser
from pagellm.frontend.server.chat_tools import (
    ChoiceStream,
    ToolSetup,
    chat_message,
    resolve_tool_mode,
    special_tokens_in_text,
)

REASONING = "User wants the weather. Use get_weather."  # THINK's body
FINAL = harmony("final", "It is sunny.", "<|return|>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]

# (text, reasoning_content, content)
REASONING_CASES: list[tuple[str, str | None, str | None]] = [
    (THINK + FINAL, REASONING, "It is sunny."),
    # a call is neither reasoning nor content for the reasoning parser (vLLM's rule)
    (THINK + HARMONY_CALL, REASONING, None),
    (THINK + ROLE_CALL, REASONING, None),
    # several analysis messages, and a preamble before the final one: newline-joined
    (THINK + harmony("analysis", "Then answer.") + harmony("commentary", "One moment.")
     + FINAL, REASONING + "\nThen answer.", "One moment.\nIt is sunny."),
    # a built-in tool's call in the analysis channel is reasoning (vLLM's rule)
    (harmony("analysis to=browser.search code", '{"q": "x"}', "<|call|>", first=True),
     '{"q": "x"}', None),
    # cut off mid-thought; a final message with no analysis; no Harmony at all
    (harmony("analysis", "Let me", "", first=True), "Let me", None),
    (harmony("final", "42", "<|return|>", first=True), None, "42"),
    ("no tags, all answer", None, "no tags, all answer"),
    ("", None, None),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), REASONING_CASES)
def test_openai_gptoss_splits_analysis_from_the_answer(text: str, reasoning: str | None,
                                                       content: str | None) -> None:
    parser = get_reasoning_parser("openai_gptoss")()
    assert parser.extract_reasoning(text) == (reasoning, content)


def test_streamed_reasoning_equals_whole_for_any_split() -> None:
    """The hand-written cases and texts glued from Harmony's tags and pieces (fixed
    seed), fed whole, a character at a time and in random pieces."""
    rng = random.Random(0)
    texts = [case[0] for case in REASONING_CASES] + [
        "".join(rng.choice(HARMONY_FRAGMENTS) for _ in range(rng.randint(0, 8)))
        for _ in range(1500)]
    for text in texts:
        reasoning, content = GptOssReasoningParser().extract_reasoning(text)
        for pieces in ([text], list(text), _random_pieces(text, rng)):
            assert _stream(GptOssReasoningParser(), pieces)[:2] == (reasoning or "",
                                                                    content or ""), text


def test_reasoning_ends_when_the_final_message_begins() -> None:
    parser = GptOssReasoningParser()
    assert parser.feed(THINK) == {"reasoning_content": REASONING}
    assert parser.feed("<|start|>assistant<|channel|>fin") is None
    assert not parser.reasoning_ended
    assert parser.feed("al<|message|>It") == {"content": "It"}
    assert parser.reasoning_ended
    assert parser.feed(" is<|ret") == {"content": " is"}  # a partial tag is held
    assert parser.feed("urn|>") is None
    assert parser.finish() is None and parser.reasoning_ended


HARMONY_SETUP = ToolSetup(enable_auto_tool_choice=True, tool_call_parser="openai",
                          reasoning_parser="openai_gptoss")


def _streamed(text: str, setup: ToolSetup, tool_choice: str | None, seed: int
              ) -> tuple[str, str, list[dict[str, Any]], str | None]:
    stream = ChoiceStream(resolve_tool_mode(TOOLS, tool_choice, setup), setup)
    deltas = [d for piece in _random_pieces(text, random.Random(seed)) for d in stream.feed(piece)]
    deltas += stream.finish()
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
    return reasoning, content, calls, stream.finish_reason("stop")


@pytest.mark.parametrize("seed", range(5))
def test_one_reading_gives_reasoning_content_and_calls(seed: int) -> None:
    """Both parsers configured: an auto choice's message carries the analysis as
    reasoning_content and the call as tool_calls (finish_reason tool_calls), whole and
    streamed; an answer is content."""
    mode = resolve_tool_mode(TOOLS, "auto", HARMONY_SETUP)
    text = THINK + HARMONY_CALL
    message, reason = chat_message(text, "stop", mode, HARMONY_SETUP)
    (call,) = message["tool_calls"]
    assert (message["reasoning_content"], message["content"], reason) == (
        REASONING, None, "tool_calls")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert _streamed(text, HARMONY_SETUP, "auto", seed) == (
        REASONING, "", [call["function"]], "tool_calls")

    message, reason = chat_message(THINK + FINAL, "stop", mode, HARMONY_SETUP)
    assert (message["reasoning_content"], message["content"], reason) == (
        REASONING, "It is sunny.", "stop")
    assert "tool_calls" not in message
    assert _streamed(THINK + FINAL, HARMONY_SETUP, "auto", seed) == (
        REASONING, "It is sunny.", [], "stop")


@pytest.mark.parametrize("seed", range(3))
def test_the_openai_tool_parser_alone_shows_no_tags(seed: int) -> None:
    """No reasoning parser: the analysis is left out, an answer without calls is the
    final message's text (not the raw output), whole and streamed."""
    setup = ToolSetup(True, "openai")
    message, reason = chat_message(THINK + FINAL, "stop",
                                   resolve_tool_mode(TOOLS, "auto", setup), setup)
    assert message == {"role": "assistant", "content": "It is sunny."} and reason == "stop"
    assert _streamed(THINK + FINAL, setup, "auto", seed) == ("", "It is sunny.", [], "stop")


def test_without_an_auto_choice_calls_are_not_reported() -> None:
    """tool_choice "none": the reasoning parser alone reads the output; a call the model
    made anyway is neither content nor a call (vLLM's rule)."""
    mode = resolve_tool_mode(TOOLS, "none", HARMONY_SETUP)
    message, reason = chat_message(THINK + HARMONY_CALL, "stop", mode, HARMONY_SETUP)
    assert message == {"role": "assistant", "reasoning_content": REASONING, "content": None}
    assert reason == "stop"
    assert _streamed(THINK + HARMONY_CALL, HARMONY_SETUP, "none", 0) == (
        REASONING, "", [], "stop")


def test_harmony_reasoning_hands_the_answer_to_another_tool_parser() -> None:
    """With a different tool parser (hermes), the final message's text is what that
    parser reads: the reasoning parser's content, as for every reasoning parser."""
    setup = ToolSetup(True, "hermes", "openai_gptoss")
    body = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    message, reason = chat_message(THINK + harmony("final", body), "stop",
                                   resolve_tool_mode(TOOLS, "auto", setup), setup)
    assert message["reasoning_content"] == REASONING and reason == "tool_calls"
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'


@pytest.mark.parametrize(("setup", "tool_choice", "expected"), [
    (HARMONY_SETUP, "auto", True), (HARMONY_SETUP, "none", True),
    (ToolSetup(reasoning_parser="openai_gptoss"), None, True),
    (ToolSetup(True, "openai"), "auto", True),
    (ToolSetup(True, "openai"), "none", False),  # no parser reads this output
    (ToolSetup(True, "hermes", "qwen3"), "auto", False),
    (ToolSetup(), None, False)])
def test_which_requests_keep_special_tokens_in_their_text(setup: ToolSetup,
                                                          tool_choice: str | None,
                                                          expected: bool) -> None:
    tools = TOOLS if tool_choice else None
    mode = resolve_tool_mode(tools, tool_choice, setup)
    assert special_tokens_in_text(setup, mode) is expected
