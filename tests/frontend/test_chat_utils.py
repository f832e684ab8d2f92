"""frontend/chat_utils.py: chat messages as templates read them, the same offline
(`LLM.chat`) as on the server (issue 39): an assistant's tool calls with their JSON
arguments parsed, everything else as given, the caller's messages untouched. The
reference is transformers' apply_chat_template on the conversation parsed by hand."""

from __future__ import annotations

import copy
import json

from pagellm import SamplingParams
from pagellm.frontend.chat_utils import template_messages, template_tool_call

TOOL_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}{% if m.tool_call_id %}#{{ m.tool_call_id }}"
    "{% endif %}]{{ m['content'] or '' }}{% for c in m.tool_calls or [] %}"
    "<call {{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}>"
    "{% endfor %}{% endfor %}{% for t in tools or [] %}<tool {{ t['function']['name'] }}>"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def test_tool_call_arguments_are_parsed_only_when_they_are_a_json_object():
    parsed = template_tool_call(CALL)
    assert parsed["function"]["arguments"] == {"city": "Paris"} and parsed["id"] == "c1"
    for arguments in ("not json", "[1, 2]", "3"):
        call = {"function": {"name": "f", "arguments": arguments}}
        assert template_tool_call(call) == call
    for odd in ("a string", {"function": "f"}, {"type": "function"}):
        assert template_tool_call(odd) == odd
    before = copy.deepcopy(HISTORY)
    messages = template_messages(HISTORY)
    assert before == HISTORY  # the caller's messages are left as they were
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[0] is HISTORY[0] and messages[2] is HISTORY[2]


def test_llm_chat_renders_a_tool_conversation_as_the_server_does(model_dirs, make_llm):
    llm = make_llm(model_dirs["llama"])
    out = llm.chat(HISTORY, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False,
                   chat_template=TOOL_TEMPLATE, tools=TOOLS)[0]
    parsed = copy.deepcopy(HISTORY)
    parsed[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    text = llm.tokenizer.apply_chat_template(parsed, chat_template=TOOL_TEMPLATE,
                                             tools=TOOLS, add_generation_prompt=True,
                                             tokenize=False)
    assert '<call get_weather {"city": "Paris"}>' in text and "[tool#c1]sunny" in text
    assert out.prompt == text
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)


REASONING_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{% if m.thinking %}<analysis {{ m.thinking }}>"
    "{% endif %}{% if m.reasoning_content %}<think {{ m.reasoning_content }}>{% endif %}"
    "{{ m['content'] or '' }}{% endfor %}")


def test_earlier_reasoning_reaches_templates_under_their_names(model_dirs, make_llm):
    """A client sends an assistant's reasoning back as `reasoning_content` (what the
    server returned) or `reasoning`; gpt-oss's template reads `thinking`, Qwen3's
    `reasoning_content`: both get it, offline and on the server alike. The reference is
    apply_chat_template on the conversation with both names written by hand."""
    from pagellm.frontend.server.api_models import ChatMessage

    llm = make_llm(model_dirs["llama"])
    for name in ("reasoning_content", "reasoning"):
        history = [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello", name: "greet back"}]
        by_hand = [history[0], {**history[1], "reasoning_content": "greet back",
                                "thinking": "greet back"}]
        expected = llm.tokenizer.apply_chat_template(
            by_hand, chat_template=REASONING_TEMPLATE, tokenize=False)
        assert "<analysis greet back><think greet back>Hello" in expected
        out = llm.chat(history, SamplingParams(max_tokens=1), use_tqdm=False,
                       chat_template=REASONING_TEMPLATE, add_generation_prompt=False)[0]
        assert out.prompt == expected
        server_side = [ChatMessage(**m).template_message() for m in history]
        assert server_side == template_messages(history)
        # given under both names here, not left to the template engine (transformers 5.0,
        # the floor, does not map them; later releases do)
        assert {k: server_side[1].get(k) for k in ("reasoning_content", "thinking")} == {
            "reasoning_content": "greet back", "thinking": "greet back"}
    plain = [{"role": "user", "content": "Hi"}]
    assert template_messages(plain)[0] is plain[0]  # no reasoning: as given
