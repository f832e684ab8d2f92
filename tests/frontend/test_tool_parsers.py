"""frontend/tool_parsers: the hermes, llama3_json, pythonic, DeepSeek (V3, V3.1), GLM-4.5
and 4.7 (glm45, glm47), Qwen3-Coder's and Seed-OSS's XML, MiniMax-M2's invokes
(minimax_m2), Mistral's [TOOL_CALLS] (mistral), OLMo 3's lines of Python calls (olmo3)
and gpt-oss's Harmony (openai) formats turned into OpenAI tool calls and content. The
reference is the expected results written by hand below; streaming is checked against
the whole-output result for every string, fed in random pieces, one character at a time
and all at once."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest

from pagellm.frontend.tool_parsers import (
    TOOL_PARSERS,
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
    Ernie45ToolParser,
    Glm45ToolParser,
    Glm47ToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MiniMaxM2ToolParser,
    MistralToolParser,
    Olmo3ToolParser,
    OpenAIToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    Qwen3XmlToolParser,
    SeedOssToolParser,
    ToolCall,
    ToolParser,
    get_tool_parser,
)

# (text, [(name, arguments JSON text)], content)
HERMES_CASES: list[tuple[str, list[tuple[str, str]], str | None]] = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
     "</tool_call>",
     [("get_weather", '{"city": "Paris", "unit": "c"}')], None),
    # content before the calls; the newline between the blocks is no content
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
     [("a", '{"x": 1}'), ("b", "{}")], "Let me check.\n"),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name": "b", "arguments": {"n": 2}}</tool_call>\n'
     '<tool_call>{"name": "c", "arguments": {"s": "t"}}</tool_call>\n',
     [("a", "{}"), ("b", '{"n": 2}'), ("c", '{"s": "t"}')], None),
    # arguments are re-serialized: json.dumps spacing, nested values kept
    ('<tool_call>{"name":"a","arguments":{"x":[1,2],"y":null,"z":{"w":false}}}</tool_call>',
     [("a", '{"x": [1, 2], "y": null, "z": {"w": false}}')], None),
    # malformed JSON inside the block: no call, the whole output is content
    ('Sure <tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>', [],
     'Sure <tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>'),
    ("<tool_call>not json</tool_call>", [], "<tool_call>not json</tool_call>"),
    # unicode arguments, raw and \u-escaped, come back unescaped
    ('<tool_call>{"name": "translate", "arguments": {"text": "héllo wörld 日本語", '
     '"emoji": "🙂", "esc": "caf\\u00e9"}}</tool_call>',
     [("translate", '{"text": "héllo wörld 日本語", "emoji": "🙂", "esc": "café"}')], None),
    # an unterminated last block counts when its JSON is complete
    ('<tool_call>\n{"name": "a", "arguments": {"q": "x"}}\n', [("a", '{"q": "x"}')], None),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_', [("a", "{}")], None),
    ('Hi <tool_call>\n{"name": "a", "argu', [], 'Hi <tool_call>\n{"name": "a", "argu'),
    # text after the calls stays content; a bad block among good ones is content
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\nDone.', [("a", "{}")],
     "\nDone."),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>oops</tool_call>',
     [("a", "{}")], "\n<tool_call>oops</tool_call>"),
    # arguments that are no object (here a double-encoded string), NaN, no name
    ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', [],
     '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'),
    ('<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>', [],
     '<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>'),
    ('<tool_call>{"arguments": {}}</tool_call>', [], '<tool_call>{"arguments": {}}</tool_call>'),
    ('<tool_call>[{"name": "a", "arguments": {}}]</tool_call>', [],
     '<tool_call>[{"name": "a", "arguments": {}}]</tool_call>'),
    # plain text, partial tags, whitespace
    ("Hello <tool but no tag", [], "Hello <tool but no tag"),
    ("answer <tool_ca", [], "answer <tool_ca"),
    ("a </tool_call> b", [], "a </tool_call> b"),
    ("  \n", [], None),
    ("", [], None),
]

LLAMA3_CASES: list[tuple[str, list[tuple[str, str]], str | None]] = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
     [("get_weather", '{"city": "Paris"}')], None),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": "z"}}',
     [("a", '{"x": 1}'), ("b", '{"y": "z"}')], None),
    (' \n<|python_tag|> {"name": "a", "parameters": {}} ;\n{"name":"b","parameters":{"k":[1]}};',
     [("a", "{}"), ("b", '{"k": [1]}')], None),
    ('{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {}}', [("a", "{}"), ("b", "{}")],
     None),
    # not opening with "{" (after space and the tag): content, even with JSON inside
    ('The answer is {"name": "a", "parameters": {}}', [],
     'The answer is {"name": "a", "parameters": {}}'),
    # a JSON answer is no call
    ('{"result": 42}', [], '{"result": 42}'),
    ('{"name": "a", "parameters": [1, 2]}', [], '{"name": "a", "parameters": [1, 2]}'),
    # after a call, what is not a call is content
    ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": [1]}', [("a", "{}")],
     '; {"name": "b", "parameters": [1]}'),
    ('{"name": "a", "parameters": {}}\nI called a.', [("a", "{}")], "\nI called a."),
    ('{"name": "a", "parameters": {}};; x', [("a", "{}")], ";; x"),
    # braces and quotes inside strings do not end the object
    ('{"name": "echo", "parameters": {"text": "a } { \\" }"}}',
     [("echo", '{"text": "a } { \\" }"}')], None),
    ('{"name": "t", "parameters": {"text": "naïve 東京 🚀"}}',
     [("t", '{"text": "naïve 東京 🚀"}')], None),
    ('{"name": "a", "parameters": {"x": ', [], '{"name": "a", "parameters": {"x": '),
    ('{"name": "a", "parameters": {}}; {"name": "b", "par', [("a", "{}")],
     '; {"name": "b", "par'),
    ("<|python_tag|>", [], "<|python_tag|>"),
    ("<|python_ta", [], "<|python_ta"),
    ("<|python_tag|>print(1)", [], "<|python_tag|>print(1)"),
    ("Hello there", [], "Hello there"),
    (" \t\n", [], None),
    ("", [], None),
]

PYTHONIC_CASES: list[tuple[str, list[tuple[str, str]], str | None]] = [
    ('[get_weather(city="Paris", unit="c")]', [("get_weather", '{"city": "Paris", "unit": "c"}')],
     None),
    # nested literal arguments, True/False/None, several calls, a call without arguments
    ('[a(x=1, y=[1, {"k": None}], z=True, w=-2.5), b()]',
     [("a", '{"x": 1, "y": [1, {"k": null}], "z": true, "w": -2.5}'), ("b", "{}")], None),
    ("  <|python_start|>[f(q='héllo 世界')]<|python_end|>\n", [("f", '{"q": "héllo 世界"}')],
     None),
    ("[f(a=(1, 2), b={'n': [False]})]", [("f", '{"a": [1, 2], "b": {"n": [false]}}')], None),
    # a value that is no literal: the whole output is content
    ("[f(a=x)]", [], "[f(a=x)]"),
    ('[f(a=__import__("os").getcwd())]', [], '[f(a=__import__("os").getcwd())]'),
    ("[f(a=1 + 2)]", [], "[f(a=1 + 2)]"),
    ("[f(a={1, 2})]", [], "[f(a={1, 2})]"),
    ("[f(a=1e999)]", [], "[f(a=1e999)]"),
    ("[f(a=b'x')]", [], "[f(a=b'x')]"),
    ("[f(1)]", [], "[f(1)]"),
    ("[f(a=1, a=2)]", [], "[f(a=1, a=2)]"),
    ("[f(**k)]", [], "[f(**k)]"),
    ('[os.system(cmd="ls")]', [], '[os.system(cmd="ls")]'),
    ("[f(a=1), 3]", [], "[f(a=1), 3]"),
    ("[]", [], "[]"),
    ("[f(a=1), ", [], "[f(a=1), "),
    ("[f(a=1)] and more", [], "[f(a=1)] and more"),
    ("Hello [f(a=1)]", [], "Hello [f(a=1)]"),
    ("<|python_start|>hi", [], "<|python_start|>hi"),
    ("\n", [], None),
    ("", [], None),
]

# DeepSeek's tokens
CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def v3_block(name: str, arguments: str) -> str:
    return f"{CALL}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


DEEPSEEK_V3_CASES: list[tuple[str, list[tuple[str, str]], str | None]] = [
    (CALLS + v3_block("get_weather", '{"city": "Paris"}') + CALLS_END,
     [("get_weather", '{"city": "Paris"}')], None),
    # content before; two calls, arguments re-serialized, unicode kept; no content after
    ("Let me look.\n\n" + CALLS + v3_block("a", '{"x":1}') + "\n" + v3_block("b", "{}")
     + CALLS_END, [("a", '{"x": 1}'), ("b", "{}")], "Let me look.\n\n"),
    (CALLS + v3_block("t", '{"s": "日本 \\u00e9"}') + CALLS_END, [("t", '{"s": "日本 é"}')],
     None),
    # arguments over several lines
    (CALLS + v3_block("f", '{\n  "k": [1,\n 2]\n}') + CALLS_END, [("f", '{"k": [1, 2]}')],
     None),
    # an unterminated last block counts when complete (a cut tag after it is content,
    # as any partial tag at the end)
    (CALLS + f"{CALL}function{SEP}f\n```json\n{{}}\n```", [("f", "{}")], None),
    (CALLS + v3_block("f", "{}") + "<｜tool▁calls", [("f", "{}")], "<｜tool▁calls"),
    # bad blocks stay content (arguments no object, no fence, no name), tags and all
    (CALLS + v3_block("f", "[1]") + CALLS_END, [], v3_block("f", "[1]")),
    (CALLS + f"{CALL}function{SEP}f {{}}{CALL_END}" + CALLS_END, [],
     f"{CALL}function{SEP}f {{}}{CALL_END}"),
    (CALLS + v3_block(" ", "{}") + CALLS_END, [], v3_block(" ", "{}")),
    # text after the section stays content; wrappers alone are no content
    (CALLS + v3_block("f", "{}") + CALLS_END + "Done.", [("f", "{}")], "Done."),
    (CALLS + CALLS_END, [], None),
    ("Plain <｜tool▁ca", [], "Plain <｜tool▁ca"),
    ("", [], None),
]

DEEPSEEK_V31_CASES: list[tuple[str, list[tuple[str, str]], str | None]] = [
    (f'{CALLS}{CALL}get_weather{SEP}{{"city": "Paris"}}{CALL_END}{CALLS_END}',
     [("get_weather", '{"city": "Paris"}')], None),
    (f'Sure.{CALLS}{CALL}a{SEP}{{"x":1}}{CALL_END}{CALL}b{SEP}{{}}{CALL_END}{CALLS_END}',
     [("a", '{"x": 1}'), ("b", "{}")], "Sure."),
    (f"{CALLS}{CALL}a{SEP}not json{CALL_END}{CALLS_END}", [],
     f"{CALL}a{SEP}not json{CALL_END}"),
    (f"{CALLS}{CALL}a{SEP}{{}}", [("a", "{}")], None),
    (f"{CALLS}{CALL}{SEP}{{}}{CALL_END}", [], f"{CALL}{SEP}{{}}{CALL_END}"),
    ("no calls here", [], "no calls here"),
]

def glm_block(name: str, *pairs: tuple[str, str]) -> str:
    return (f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}"
                                             "</arg_value>\n" for k, v in pairs)
            + "</tool_call>")


GLM45_CASES: list[tuple[str, list[tuple[str, str]], str | None]] = [
    (glm_block("get_weather", ("city", "Paris"), ("days", "3")),
     [("get_weather", '{"city": "Paris", "days": 3}')], None),
    # values read as JSON, else Python literals, else kept as text (stripped)
    ("Checking.\n" + glm_block("f", ("a", '{"k": [1, 2]}'), ("b", "True"), ("c", " hi there "),
                                ("d", "None"), ("e", "'q'")) + "\n" + glm_block("g"),
     [("f", '{"a": {"k": [1, 2]}, "b": true, "c": "hi there", "d": null, "e": "q"}'),
      ("g", "{}")], "Checking.\n"),
    ("<tool_call>f<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>", [("f", '{"x": 1}')],
     None),
    # an unterminated last block counts when its pairs are complete
    ("<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>日本</arg_value>\n",
     [("f", '{"x": "日本"}')], None),
    # bad blocks stay content: no name, text among the pairs, a repeated key, a pair cut
    (glm_block(""), [], glm_block("")),
    ("<tool_call>f\nsay <arg_key>x</arg_key><arg_value>1</arg_value></tool_call>", [],
     "<tool_call>f\nsay <arg_key>x</arg_key><arg_value>1</arg_value></tool_call>"),
    (glm_block("f", ("x", "1"), ("x", "2")), [], glm_block("f", ("x", "1"), ("x", "2"))),
    ("<tool_call>f\n<arg_key>x</arg_key><arg_val", [],
     "<tool_call>f\n<arg_key>x</arg_key><arg_val"),
    (glm_block("f", ("x", "NaN")), [], glm_block("f", ("x", "NaN"))),
    ("Nothing to call.", [], "Nothing to call."),
]


def harmony(channel: str, body: str, end: str = "<|end|>", *, first: bool = False) -> str:
    """One Harmony message as gpt-oss writes it: the first of an output has no
    `<|start|>assistant` (the prompt ends with it)."""
    start = "" if first else "<|start|>assistant"
    return f"{start}<|channel|>{channel}<|message|>{body}{end}"


THINK = harmony("analysis", "User wants the weather. Use get_weather.", first=True)
# gpt-oss's two spellings of a call: the recipient after the channel with a
# <|constrain|> content type, or in the role's part with a bare one
HARMONY_CALL = harmony("commentary to=functions.get_weather <|constrain|>json",
                       '{"city":"Paris","days":3}', "<|call|>")
ROLE_CALL = ('<|start|>assistant to=functions.lookup<|channel|>commentary json'
             '<|message|>{"q": ["a", {"b": null}]}<|call|>')

OPENAI_CASES: list[tuple[str, list[tuple[str, str]], str | None]] = [
    # reasoning is no content; the final message is (the stop token's text ends it)
    (THINK + harmony("final", "It is sunny.", "<|return|>"), [], "It is sunny."),
    (THINK + HARMONY_CALL, [("get_weather", '{"city": "Paris", "days": 3}')], None),
    (THINK + ROLE_CALL, [("lookup", '{"q": ["a", {"b": null}]}')], None),
    # a preamble (commentary to no one) is shown; calls in one output, in order
    (harmony("commentary", "Checking two cities.", first=True) + HARMONY_CALL
     + harmony("commentary to=functions.get_weather", '{"city": "Rome"}', "<|call|>"),
     [("get_weather", '{"city": "Paris", "days": 3}'), ("get_weather", '{"city": "Rome"}')],
     "Checking two cities."),
    # preamble and final joined by a newline; unicode kept
    (harmony("commentary", "Un moment…", first=True) + harmony("final", "日本 🙂"), [],
     "Un moment…\n日本 🙂"),
    # a body that is no JSON object is content; an empty function name too
    (THINK + harmony("commentary to=functions.f <|constrain|>json", '{"a": ', "<|call|>"),
     [], '{"a": '),
    (harmony("commentary to=functions.f", "[1, 2]", "<|call|>", first=True), [], "[1, 2]"),
    (harmony("commentary to=functions. json", "{}", "<|call|>", first=True), [], "{}"),
    # built-in tools' calls are neither content nor calls (the chat API runs none)
    (harmony("analysis to=browser.search code", '{"query": "x"}', "<|call|>", first=True)
     + harmony("commentary to=python", "print(1)", "<|call|>"), [], None),
    # cut off: in the reasoning, in a header, in the answer, in a complete call
    (harmony("analysis", "Still thinking", "", first=True), [], None),
    (THINK + "<|start|>assistant<|channel|>fin", [], None),
    (THINK + harmony("final", "Partial ans", ""), [], "Partial ans"),
    (harmony("commentary to=functions.f", '{"x": 1}', "", first=True), [("f", '{"x": 1}')],
     None),
    # a tag inside a body is its text; whitespace alone is no content
    (harmony("final", "a <|channel|> b <|constrain|>", first=True), [],
     "a <|channel|> b <|constrain|>"),
    (THINK + harmony("final", " \n "), [], None),
    # an output in no Harmony at all is the answer, whole
    ("Plain answer, no tags.", [], "Plain answer, no tags."),
    ("", [], None),
]

# GLM-4.7 writes the name straight into the first key (vLLM's glm47 template)
GLM47_CASES: list[tuple[str, list[tuple[str, str]], str | None]] = [
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
     "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
     [("get_weather", '{"city": "Paris", "days": 3}')], None),
    ("Sure.<tool_call>f<arg_key>q</arg_key>\n<arg_value>[1]</arg_value></tool_call>"
     "<tool_call>g</tool_call>", [("f", '{"q": [1]}'), ("g", "{}")], "Sure."),
]


def xml_call(name: str, *pairs: tuple[str, str], start: str = "<tool_call>",
             end: str = "</tool_call>") -> str:
    """A Qwen3-Coder block as its chat template writes one: a line per tag and value."""
    return (f"{start}\n<function={name}>\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in pairs) + f"</function>\n{end}")


# Without the request's tools every value is text (but null)
QWEN3_CODER_CASES: list[tuple[str, list[tuple[str, str]], str | None]] = [
    (xml_call("get_weather", ("city", "Paris"), ("days", "3")),
     [("get_weather", '{"city": "Paris", "days": "3"}')], None),
    # content before; two calls; a value over several lines keeps its inner newlines
    ("Let me check.\n" + xml_call("run", ("code", "def f():\n    return 1")) + "\n"
     + xml_call("noop"),
     [("run", '{"code": "def f():\\n    return 1"}'), ("noop", "{}")], "Let me check.\n"),
    # null is null whatever the type; unicode kept; tags on one line
    ("<tool_call><function=f><parameter=x>null</parameter><parameter=s>日本 🙂</parameter>"
     "</function></tool_call>", [("f", '{"x": null, "s": "日本 🙂"}')], None),
    # an unterminated last block counts when its function is complete
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>",
     [("f", '{"a": "1"}')], None),
    # bad blocks stay content: no </function>, text among the parameters, a repeated
    # key, no name, two functions in one block
    ("<tool_call><function=f><parameter=a>1</parameter></tool_call>", [],
     "<tool_call><function=f><parameter=a>1</parameter></tool_call>"),
    ("<tool_call><function=f>say <parameter=a>1</parameter></function></tool_call>", [],
     "<tool_call><function=f>say <parameter=a>1</parameter></function></tool_call>"),
    (xml_call("f", ("a", "1"), ("a", "2")), [], xml_call("f", ("a", "1"), ("a", "2"))),
    ("<tool_call><function= ></function></tool_call>", [],
     "<tool_call><function= ></function></tool_call>"),
    ("<tool_call><function=f></function><function=g></function></tool_call>", [],
     "<tool_call><function=f></function><function=g></function></tool_call>"),
    ("No tools needed.", [], "No tools needed."),
]
SEED_OSS_CASES: list[tuple[str, list[tuple[str, str]], str | None]] = [
    (xml_call("get_weather", ("city", "Rome"), start="<seed:tool_call>",
              end="</seed:tool_call>"), [("get_weather", '{"city": "Rome"}')], None),
    ("Sure." + xml_call("f", start="<seed:tool_call>", end="</seed:tool_call>"),
     [("f", "{}")], "Sure."),
    (xml_call("f"), [], xml_call("f")),  # Qwen's tags are not Seed's
]



def invoke(name: str, *pairs: tuple[str, str], quote: str = '"') -> str:
    """One MiniMax-M2 invoke as its chat template writes one: a line per parameter."""
    return (f"<invoke name={quote}{name}{quote}>\n" + "".join(
        f"<parameter name={quote}{k}{quote}>{v}</parameter>\n" for k, v in pairs)
        + "</invoke>\n")


def minimax_block(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


# Without the request's tools every value is text (but null, none, nil)
MINIMAX_M2_CASES: list[tuple[str, list[tuple[str, str]], str | None]] = [
    (minimax_block(invoke("get_weather", ("city", "Paris"), ("days", "3"))),
     [("get_weather", '{"city": "Paris", "days": "3"}')], None),
    # two invokes in one block, then another block; thinking and text before stay
    ("<think>\nUse the tools.\n</think>\n\n" + minimax_block(
        invoke("a", ("x", " 1 ")), invoke("b")) + "\n" + minimax_block(invoke("c")),
     [("a", '{"x": "1"}'), ("b", "{}"), ("c", "{}")],
     "<think>\nUse the tools.\n</think>\n\n"),
    # single quotes, bare names; null/None/nil are null; a value over lines, unicode
    (minimax_block(invoke("f", ("s", "日本 🙂"), ("n", "None"), quote="'"),
                   '<invoke name=g><parameter name=k>nil</parameter></invoke>',
                   invoke("h", ("code", "def f():\n    return 1"))),
     [("f", '{"s": "日本 🙂", "n": null}'), ("g", '{"k": null}'),
      ("h", '{"code": "def f():\\n    return 1"}')], None),
    # an unterminated last block counts when its invokes are complete
    ("<minimax:tool_call>\n" + invoke("f", ("a", "1")), [("f", '{"a": "1"}')], None),
    # bad blocks stay content: an invoke cut off, text between invokes or among the
    # parameters, a repeated key, no name, a name with a space, an empty block
    ("<minimax:tool_call><invoke name=\"f\"><parameter name=\"a\">1</parameter>"
     "</minimax:tool_call>", [],
     "<minimax:tool_call><invoke name=\"f\"><parameter name=\"a\">1</parameter>"
     "</minimax:tool_call>"),
    (minimax_block(invoke("f"), "and ", invoke("g")), [],
     minimax_block(invoke("f"), "and ", invoke("g"))),
    (minimax_block('<invoke name="f">say <parameter name="a">1</parameter></invoke>'), [],
     minimax_block('<invoke name="f">say <parameter name="a">1</parameter></invoke>')),
    (minimax_block(invoke("f", ("a", "1"), ("a", "2"))), [],
     minimax_block(invoke("f", ("a", "1"), ("a", "2")))),
    (minimax_block('<invoke name=""></invoke>'), [],
     minimax_block('<invoke name=""></invoke>')),
    (minimax_block('<invoke name="get weather"></invoke>'), [],
     minimax_block('<invoke name="get weather"></invoke>')),
    (minimax_block(), [], minimax_block()),
    # Qwen-style and Hermes-style blocks are no MiniMax calls
    (xml_call("f"), [], xml_call("f")),
    ("No tools needed.", [], "No tools needed."),
]

MISTRAL_CASES: list[tuple[str, list[tuple[str, str]], str | None]] = [
    # before v11: one JSON array of calls
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
     [("get_weather", '{"city": "Paris", "days": 3}')], None),
    ('Let me check. [TOOL_CALLS][{"name": "a", "arguments": {"x": "日本"}}, '
     '{"name": "b", "arguments": {}}]', [("a", '{"x": "日本"}'), ("b", "{}")],
     "Let me check. "),
    # v11 and later: a name and its arguments per [TOOL_CALLS], with [ARGS] and
    # [CALL_ID] where the tokenizer has them, or the name straight into the object
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")], None),
    ('[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"q": [1, {"k": "}"}]}\n\n[TOOL_CALLS]g{}',
     [("f", '{"q": [1, {"k": "}"}]}'), ("g", "{}")], None),
    # text after the calls is content; whitespace alone is not
    ('[TOOL_CALLS]f[ARGS]{"a": 1}\nDone.', [("f", '{"a": 1}')], "\nDone."),
    ('[TOOL_CALLS]f[ARGS]{}  \n', [("f", "{}")], None),
    # calls read while well formed: the first that is not, and all after it, is content
    ('[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]bad name[ARGS]{}[TOOL_CALLS]g[ARGS]{}',
     [("f", "{}")], "[TOOL_CALLS]bad name[ARGS]{}[TOOL_CALLS]g[ARGS]{}"),
    ('[TOOL_CALLS]f[ARGS]{} then [TOOL_CALLS]g[ARGS]{}', [("f", "{}")],
     " then [TOOL_CALLS]g[ARGS]{}"),
    # no call at all: arguments no object, an array of no calls, NaN, a name missing,
    # cut off (in the name, in the arguments), two tags, a partial tag
    ('[TOOL_CALLS]f[ARGS][1, 2]', [], '[TOOL_CALLS]f[ARGS][1, 2]'),
    ('[TOOL_CALLS] [{"name": "f"}]', [], '[TOOL_CALLS] [{"name": "f"}]'),
    ('[TOOL_CALLS] []', [], '[TOOL_CALLS] []'),
    ('[TOOL_CALLS]f[ARGS]{"x": NaN}', [], '[TOOL_CALLS]f[ARGS]{"x": NaN}'),
    ('[TOOL_CALLS][ARGS]{}', [], '[TOOL_CALLS][ARGS]{}'),
    ("  [TOOL_CALLS]get_wea", [], "  [TOOL_CALLS]get_wea"),
    ('[TOOL_CALLS]f[ARGS]{"a": ', [], '[TOOL_CALLS]f[ARGS]{"a": '),
    ("[TOOL_CALLS][TOOL_CALLS]f{}", [], "[TOOL_CALLS][TOOL_CALLS]f{}"),
    ("Answer [TOOL_CA", [], "Answer [TOOL_CA"),
    ("No tools needed.", [], "No tools needed."),
]

OLMO3_CASES: list[tuple[str, list[tuple[str, str]], str | None]] = [
    ("<function_calls>\nget_weather(city='Paris', days=3)\nget_time(zone=null)\n"
     "</function_calls>", [("get_weather", '{"city": "Paris", "days": 3}'),
                           ("get_time", '{"zone": null}')], None),
    # JSON's and Python's literals both; text before and after; blank lines skipped
    ('Checking.<function_calls>f(a=true, b=False, c=[1, {"k": "日本"}])\n\n'
     "</function_calls> Done.", [("f", '{"a": true, "b": false, "c": [1, {"k": "日本"}]}')],
     "Checking. Done."),
    # an unterminated last block counts when its lines are calls
    ("<function_calls>\nf()\n", [("f", "{}")], None),
    # bad blocks stay content: a line that is no call, a positional argument, a
    # variable, two calls on a line, an empty block
    ("<function_calls>\nf()\nsure\n</function_calls>", [],
     "<function_calls>\nf()\nsure\n</function_calls>"),
    ("<function_calls>f(1)</function_calls>", [], "<function_calls>f(1)</function_calls>"),
    ("<function_calls>f(a=x)</function_calls>", [],
     "<function_calls>f(a=x)</function_calls>"),
    ("<function_calls>f(), g()</function_calls>", [],
     "<function_calls>f(), g()</function_calls>"),
    ("<function_calls>\n</function_calls>", [], "<function_calls>\n</function_calls>"),
    # calls outside a block are an answer (vLLM reads them when not streaming)
    ("get_weather(city='Paris')", [], "get_weather(city='Paris')"),
]

# ERNIE 4.5 (what follows `</think>`, the reasoning parser having taken the thinking):
# Hermes's blocks, one a line
ERNIE45_CASES = [
    ('\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Beijing"}}\n'
     '</tool_call>\n', [("get_weather", '{"city": "Beijing"}')], None),
    ('Checking.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n'
     '{"name": "g", "arguments": {"n": 2}}\n</tool_call>', [("f", "{}"), ("g", '{"n": 2}')],
     "Checking.\n"),
]

CASES = [(HermesToolParser, *case) for case in HERMES_CASES] + \
        [(Ernie45ToolParser, *case) for case in HERMES_CASES + ERNIE45_CASES] + \
        [(Llama3JsonToolParser, *case) for case in LLAMA3_CASES] + \
        [(PythonicToolParser, *case) for case in PYTHONIC_CASES] + \
        [(DeepSeekV3ToolParser, *case) for case in DEEPSEEK_V3_CASES] + \
        [(DeepSeekV31ToolParser, *case) for case in DEEPSEEK_V31_CASES] + \
        [(Glm45ToolParser, *case) for case in GLM45_CASES] + \
        [(Glm47ToolParser, *case) for case in GLM45_CASES + GLM47_CASES] + \
        [(Qwen3CoderToolParser, *case) for case in QWEN3_CODER_CASES] + \
        [(Qwen3XmlToolParser, *case) for case in QWEN3_CODER_CASES] + \
        [(SeedOssToolParser, *case) for case in SEED_OSS_CASES] + \
        [(MiniMaxM2ToolParser, *case) for case in MINIMAX_M2_CASES] + \
        [(MistralToolParser, *case) for case in MISTRAL_CASES] + \
        [(Olmo3ToolParser, *case) for case in OLMO3_CASES] + \
        [(OpenAIToolParser, *case) for case in OPENAI_CASES]
ALL_TEXTS = sorted({case[0] for case in HERMES_CASES + LLAMA3_CASES + PYTHONIC_CASES
                    + DEEPSEEK_V3_CASES + DEEPSEEK_V31_CASES + GLM45_CASES
                    + GLM47_CASES + OPENAI_CASES + QWEN3_CODER_CASES
                    + SEED_OSS_CASES + MINIMAX_M2_CASES + MISTRAL_CASES
                    + OLMO3_CASES})


# The parsers whose code differs: glm47, qwen3_xml and ernie45 are glm45's, qwen3_coder's
# and hermes's
# classes under vLLM's other names (their cases run in test_extract_tool_calls); the property tests
# below would only run the same code twice.
DISTINCT_PARSERS = sorted(set(TOOL_PARSERS) - {"glm47", "qwen3_xml", "ernie45"})


@pytest.mark.parametrize(("parser_class", "text", "calls", "content"), CASES)
def test_extract_tool_calls(parser_class: type[ToolParser], text: str,
                            calls: list[tuple[str, str]], content: str | None) -> None:
    result = parser_class().extract_tool_calls(text)
    assert [(c.name, c.arguments) for c in result.tool_calls] == calls
    assert result.tools_called == bool(calls)
    assert result.content == content
    for call in result.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Feeds the pieces, then finishes: the content joined and the streamed calls,
    checking the shape of every delta on the way."""
    deltas: list[dict[str, Any]] = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    content = ""
    calls = []
    for delta in deltas:
        assert len(delta) == 1, delta
        if "content" in delta:
            assert isinstance(delta["content"], str) and delta["content"], delta
            content += delta["content"]
        else:
            (call,) = delta["tool_calls"]
            assert set(call) == {"index", "id", "type", "function"}
            assert call["type"] == "function"
            if isinstance(parser, MistralToolParser):  # what its templates require
                assert len(call["id"]) == 9 and call["id"].isalnum(), call["id"]
            else:
                assert call["id"].startswith("chatcmpl-tool-")
            assert set(call["function"]) == {"name", "arguments"}
            calls.append(call)
    assert [call["index"] for call in calls] == list(range(len(calls)))
    assert len({call["id"] for call in calls}) == len(calls)
    return content, calls


def _random_pieces(text: str, rng: random.Random) -> list[str]:
    pieces = []
    pos = 0
    while pos < len(text):
        size = rng.choice([0, 1, 1, 2, 3, 5, 8, 13])
        pieces.append(text[pos:pos + size])
        pos += size
    return pieces


@pytest.mark.parametrize("name", DISTINCT_PARSERS)
def test_streaming_equals_extract_for_every_text_and_split(name: str) -> None:
    """Every test string (each parser's own and the other formats') fed to every parser
    in random pieces: the streamed content and calls are the extracted ones."""
    parser_class = get_tool_parser(name)
    rng = random.Random(0)
    for text in ALL_TEXTS:
        expected = parser_class().extract_tool_calls(text)
        splits = [[text], list(text)] + [_random_pieces(text, rng) for _ in range(20)]
        for pieces in splits:
            content, calls = _stream(parser_class(), pieces)
            assert content == (expected.content or ""), (text, pieces)
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
                [(c.name, c.arguments) for c in expected.tool_calls], (text, pieces)


def test_streaming_sends_calls_and_content_as_soon_as_they_are_certain() -> None:
    hermes = HermesToolParser()
    assert hermes.feed("Checking <tool") == [{"content": "Checking "}]  # "<tool" held
    assert hermes.feed('_call>{"name": "a", "arguments": {}}') == []
    (delta,) = hermes.feed("</tool_call>\n")
    assert delta["tool_calls"][0]["index"] == 0
    assert delta["tool_calls"][0]["function"] == {"name": "a", "arguments": "{}"}
    assert hermes.feed("\n") == []  # whitespace between calls is held
    assert hermes.feed("Done") == [{"content": "\n\nDone"}]
    assert hermes.finish() == []

    llama = Llama3JsonToolParser()
    assert llama.feed('<|python_tag|>{"name": "a", "parameters": {}}') != []
    assert llama.feed('; {"name": "b", "parameters": {"x": 1}}')[0]["tool_calls"][0][
        "index"] == 1
    assert llama.finish() == []

    plain = Llama3JsonToolParser()
    assert plain.feed("  ") == []
    assert plain.feed("Hi") == [{"content": "  Hi"}]
    assert PythonicToolParser().feed("The [answer]") == [{"content": "The [answer]"}]


def test_tool_call_to_openai_and_registry() -> None:
    call = ToolCall(name="f", arguments='{"a": 1}')
    assert call.id.startswith("chatcmpl-tool-") and len(call.id) == len("chatcmpl-tool-") + 24
    assert ToolCall(name="f", arguments="{}").id != call.id
    assert call.to_openai() == {"id": call.id, "type": "function",
                                "function": {"name": "f", "arguments": '{"a": 1}'}}
    expected = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                "pythonic": PythonicToolParser, "deepseek_v3": DeepSeekV3ToolParser,
                "deepseek_v31": DeepSeekV31ToolParser, "glm45": Glm45ToolParser,
                "glm47": Glm47ToolParser, "openai": OpenAIToolParser,
                "qwen3_coder": Qwen3CoderToolParser, "qwen3_xml": Qwen3XmlToolParser,
                "seed_oss": SeedOssToolParser, "minimax_m2": MiniMaxM2ToolParser,
                "mistral": MistralToolParser, "olmo3": Olmo3ToolParser,
                "ernie45": Ernie45ToolParser}
    assert expected == TOOL_PARSERS
    for name, parser_class in TOOL_PARSERS.items():
        assert get_tool_parser(name) is parser_class and parser_class.name == name
    with pytest.raises(ValueError, match=r"deepseek_v3.*glm45.*hermes.*llama3_json.*pythonic"):
        get_tool_parser("mistral_v7")


def test_glm45_keeps_the_values_the_tools_schema_types_as_strings() -> None:
    """A value whose parameter the request's tool declares a string stays text ("3",
    "True"); the same values of an undeclared parameter or another tool are read."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"},
                                         "n": {"type": "integer"}}}}}]
    text = glm_block("f", ("code", "3"), ("n", "3"), ("flag", "True")) + \
        glm_block("g", ("code", "3"))
    calls = Glm45ToolParser(tools).extract_tool_calls(text).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"code": "3", "n": 3, "flag": True}), ("g", {"code": 3})]
    streamed = _stream(Glm45ToolParser(tools), list(text))[1]
    assert [c["function"]["arguments"] for c in streamed] == [c.arguments for c in calls]


def test_qwen3_coder_types_values_by_the_tools_schemas() -> None:
    """vLLM's rules for Qwen3-Coder's text values: as the tool's schema types them, text
    where they do not read as that type, text for a parameter the tool does not declare,
    null for "null"."""
    properties = {"s": {"type": "string"}, "i": {"type": "integer"},
                  "i2": {"type": "integer"}, "n": {"type": "number"},
                  "n2": {"type": "number"}, "n3": {"type": "number"},
                  "b": {"type": "boolean"}, "b2": {"type": "boolean"},
                  "o": {"type": "object"}, "a": {"type": "array"}, "u": {}, "z": {}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": properties}}}]
    pairs = [("s", "3"), ("i", "42"), ("i2", "4x"), ("n", "2.0"), ("n2", "2.5"),
             ("n3", "nan"), ("b", "True"), ("b2", "yes"), ("o", '{"k": [1]}'),
             ("a", "[1, 'a']"), ("u", "7"), ("x", "5"), ("z", "NULL")]
    text = xml_call("f", *pairs)
    (call,) = Qwen3CoderToolParser(tools).extract_tool_calls(text).tool_calls
    assert json.loads(call.arguments) == {
        "s": "3", "i": 42, "i2": "4x", "n": 2, "n2": 2.5, "n3": "nan", "b": True,
        "b2": False, "o": {"k": [1]}, "a": [1, "a"], "u": "7", "x": "5", "z": None}
    streamed = _stream(Qwen3CoderToolParser(tools), list(text))[1]
    assert [c["function"]["arguments"] for c in streamed] == [call.arguments]


def test_minimax_m2_types_values_by_every_type_their_schemas_allow() -> None:
    """vLLM's rules for MiniMax-M2's text values: every type the schema allows (a list,
    an enum's values, anyOf / oneOf / allOf branches), tried as integer, number,
    boolean (true/1/yes/on, false/0/no/off), object or array, then string; a value no
    allowed type reads is JSON if it parses, else text; null/none/nil are null."""
    properties = {
        "s": {"type": "string"}, "i": {"type": "integer"}, "i2": {"type": "integer"},
        "n": {"type": "number"}, "n2": {"type": "number"}, "n3": {"type": "number"},
        "b": {"type": "boolean"}, "b2": {"type": "boolean"}, "b3": {"type": "boolean"},
        "o": {"type": "object"}, "a": {"type": "array"},
        "either": {"type": ["string", "integer"]}, "opt": {"anyOf": [{"type": "null"},
                                                                    {"type": "number"}]},
        "deep": {"oneOf": [{"allOf": [{"type": "boolean"}]}, {"type": "string"}]},
        "enum": {"enum": [1, 2, 3]}, "nul": {"type": "null"}, "any": {}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": properties}}}]
    pairs = [("s", "3"), ("i", "42"), ("i2", "4x"), ("n", "2.0"), ("n2", "2.5"),
             ("n3", "inf"), ("b", "yes"), ("b2", "OFF"), ("b3", "maybe"),
             ("o", '{"k": [1]}'), ("a", "[1, 2]"), ("either", "7"), ("opt", "1.5"),
             ("deep", "on"), ("enum", "2"), ("nul", "[3]"), ("any", "5"), ("x", "9"),
             ("z", "NIL")]
    text = minimax_block(invoke("f", *pairs))
    (call,) = MiniMaxM2ToolParser(tools).extract_tool_calls(text).tool_calls
    assert json.loads(call.arguments) == {
        "s": "3", "i": 42, "i2": "4x", "n": 2, "n2": 2.5, "n3": "inf", "b": True,
        "b2": False, "b3": "maybe", "o": {"k": [1]}, "a": [1, 2], "either": 7,
        "opt": 1.5, "deep": True, "enum": 2, "nul": [3], "any": "5", "x": "9", "z": None}
    streamed = _stream(MiniMaxM2ToolParser(tools), list(text))[1]
    assert [c["function"]["arguments"] for c in streamed] == [call.arguments]


@pytest.mark.parametrize("name", DISTINCT_PARSERS)
def test_long_hostile_output_streams_in_bounded_work(name: str) -> None:
    """An unterminated call, a long JSON answer and a long list, fed a character at a
    time: work grows with the text, not with the text times the number of deltas (a
    rescan of everything held on each delta takes minutes here)."""
    size = 200_000
    texts = ["<tool_call>" + "x" * size, CALLS + CALL + "x" * size,
             '{"name": "a", "parameters": {"s": "' + "y" * size + '"}}',
             "[f(s='" + "z" * size + "')]",
             " " * size + "end",
             harmony("commentary to=functions.f", '{"s": "' + "w" * size, "", first=True),
             "<|channel|>analysis" + " " * size, "<|" * size]
    if name == "mistral":  # its own tags: a long name, whitespace, arguments, many calls
        texts += ["[TOOL_CALLS]" + "n" * size, "[TOOL_CALLS]" + " " * size + "x",
                  '[TOOL_CALLS]f[ARGS]{"s": "' + "v" * size, "[TOOL_CALLS]f{}" + " " * size,
                  "[TOOL_CALLS] [" + "{}, " * (size // 4), "[TOOL_CALLS]f{}" * (size // 15)]
    parser_class = get_tool_parser(name)
    for text in texts:
        expected = parser_class().extract_tool_calls(text)
        started = time.monotonic()
        content, calls = _stream(parser_class(), list(text))
        assert time.monotonic() - started < 10, text[:20]
        assert content == (expected.content or "")
        assert len(calls) == len(expected.tool_calls)


@pytest.mark.parametrize(("name", "body"), [
    ("glm45", "f\n" + "<arg_key>" * 20_000), ("glm47", "f" + "<arg_key>k</arg_key>" * 12_000),
    ("qwen3_coder", "<function=f>" + "<parameter=x>" * 15_000 + "</function>"),
    ("qwen3_xml", "<function=f>" + ("</function>" + " " * 50) * 3_000),
    ("seed_oss", "<function=f>" + "<parameter=x>" * 15_000 + "</function>"),
    ("deepseek_v3", " " * 150_000),
    ("minimax_m2", '<invoke name="f">' + '<parameter name="x">' * 12_000 + "</invoke>"),
    ("minimax_m2", "<invoke name=" * 15_000),
    ("olmo3", "f()\n" * 20_000 + "x")],
    ids=["glm45", "glm47", "qwen3_coder", "qwen3_xml", "seed_oss", "deepseek_v3",
         "minimax_m2-parameters", "minimax_m2-invokes", "olmo3"])
def test_a_block_of_many_opening_tags_is_read_in_linear_time(name: str, body: str) -> None:
    """A body read tag by tag: each tag's close found once (a regex looking for each
    opening tag's close anew took 11-15 s on these ~200k characters here; DeepSeek-V3's
    lazy type before its separator, 66 s on 150k spaces)."""
    parser_class = get_tool_parser(name)
    text = parser_class.START + body + parser_class.END  # type: ignore[attr-defined]
    started = time.monotonic()
    result = parser_class().extract_tool_calls(text)
    assert time.monotonic() - started < 2
    assert not result.tools_called and result.content == text


def test_a_run_of_wrapper_tags_is_searched_in_linear_time() -> None:
    """DeepSeek's section tags, 1.2M characters of them: each tag is searched for once
    per occurrence (searching for the block tag anew after each wrapper took ~0.3 s on
    150k characters and grows with the square)."""
    text = CALLS * 60_000
    started = time.monotonic()
    result = DeepSeekV31ToolParser().extract_tool_calls(text)
    assert time.monotonic() - started < 2
    assert not result.tools_called and result.content is None


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "</tool", "<|python_tag|>",
             "<|python_start|>", "<|python_end|>", '{"name": "f", "arguments": {"x": 1}}',
             '{"name": "g", "parameters": {}}', '{"name": "h", "arguments": {"s": "}{"}}',
             "{", "}", '"', "\\", ";", " ", "\n", "\u3000", "[f(a=1)]", "[", "]", "(", ")",
             "f(a=[1, 2])", ",", "a", "é", "<", ">", "x=", "'",
             '<tool_call>\n{"name": "f", "arguments": {"q": "<tool_call>"}}\n</tool_call>',
             '<tool_call>{"name": "g", "arguments": {}}', "[f(a=1), g(b=']')]", "[g()]",
             CALLS, CALLS_END, CALL, CALL_END, SEP, "<｜tool▁call", "function", "f",
             "\n```json\n", "\n```", '{"x": 1}', v3_block("f", '{"a": 1}'),
             f"{CALL}g{SEP}{{}}{CALL_END}", "<arg_key>", "</arg_key>", "<arg_value>",
             "</arg_value>", "get\n", glm_block("f", ("x", "1")), "<tool_call>g\n"]
# Harmony's pieces, for its parser only (among the others' they would thin out the
# calls the other formats reach)
HARMONY_FRAGMENTS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>",
                     "<|return|>", "<|constrain|>", "<|", "|>", "<|chan", "assistant",
                     "analysis", "final", "commentary", " to=functions.f", " to=browser.open",
                     "json", THINK, HARMONY_CALL, ROLE_CALL, harmony("final", "ok")]
MINIMAX_FRAGMENTS = ["<minimax:tool_call>", "</minimax:tool_call>", "<minimax:",
                     '<invoke name="f">', "<invoke name=", "</invoke>", '<parameter name="x">',
                     "<parameter name=", "</parameter>", '"', "'", "\n", "1", "null", "<think>",
                     "</think>",
                     minimax_block(invoke("f", ("x", "1"))), invoke("g")]
XML_FRAGMENTS = ["<tool_call>", "</tool_call>", "<seed:tool_call>", "</seed:tool_call>",
                 "<function=f>", "<function=", "</function>", "<parameter=x>", "<parameter=",
                 "</parameter>", "\n", "1", "null", xml_call("f", ("x", "1")),
                 xml_call("g", start="<seed:tool_call>", end="</seed:tool_call>")]
MISTRAL_FRAGMENTS = ["[TOOL_CALLS]", "[TOOL_CALLS] ", "[ARGS]", "[CALL_ID]",
                     "[CALL_ID]abc123XYZ", "[TOOL_", "[AR", "get", " ", "\n", "{", "}", "[",
                     "]", '{"a": 1}',
                     '[{"name": "f", "arguments": {}}]', '{"name": "g", "arguments": {"x": 1}}',
                     "[TOOL_CALLS]f[ARGS]{}", "NaN"]
OLMO3_FRAGMENTS = ["<function_calls>", "</function_calls>", "<function_", "f(a=1)", "g()",
                   "null", "(", ")", "=", "\n", "<function_calls>\nf(x=true)\n</function_calls>"]
EXTRA_FRAGMENTS = {"openai": HARMONY_FRAGMENTS, "qwen3_coder": XML_FRAGMENTS,
                   "mistral": MISTRAL_FRAGMENTS, "olmo3": OLMO3_FRAGMENTS,
                   "qwen3_xml": XML_FRAGMENTS, "seed_oss": XML_FRAGMENTS,
                   "minimax_m2": MINIMAX_FRAGMENTS}


@pytest.mark.parametrize("name", DISTINCT_PARSERS)
def test_streaming_equals_extract_for_generated_texts(name: str) -> None:
    """Texts glued from tags, calls, brackets, quotes and whitespace (fixed seed): the
    interleavings no hand-written case thinks of, the same streamed as whole."""
    parser_class = get_tool_parser(name)
    fragments = FRAGMENTS + EXTRA_FRAGMENTS.get(name, [])
    rng = random.Random(0)
    called = 0
    for _ in range(2500):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 8)))
        expected = parser_class().extract_tool_calls(text)
        called += expected.tools_called
        for pieces in ([text], list(text), _random_pieces(text, rng)):
            content, calls = _stream(parser_class(), pieces)
            assert content == (expected.content or ""), (text, pieces)
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
                [(c.name, c.arguments) for c in expected.tool_calls], (text, pieces)
    assert called >= 10  # the generated texts do reach the call paths
