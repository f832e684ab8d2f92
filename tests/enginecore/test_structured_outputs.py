"""Structured outputs (constrained decoding) end to end through the engine: every
constraint kind on both backends (xgrammar, llguidance as "guidance"), "auto"
falling back to guidance, the guardrails (grammars no backend takes, constraint count,
size and nesting bounds), batches that mix constrained and free requests, n > 1,
preemption, a foreign client's bad grammar at the engine core, and logprobs under a
constraint.

References are independent of the backends: `jsonschema` for JSON schemas, `re` for
regexes, membership for choices, `json.loads` for JSON objects, a hand-written parser
for the EBNF grammar, and the same engine's own unconstrained (or unpreempted) runs.
Every engine is in-process and built once per module (they take ~0.1 s each)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import msgspec
import pytest
from conftest import PROMPTS, assert_no_leaks
from helpers import request
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.demo.tokenizer import EOS_TOKEN_IDS
from pagellm.enginecore.core import EngineCore
from pagellm.enginecore.structured_output.spec import choose_backend
from pagellm.protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagellm.protocol.sampling_params import MAX_GRAMMAR_CHARS, MAX_SCHEMA_DEPTH

S = StructuredOutputsParams
KV = 8 * 2**20
EOS = 0  # the test tokenizer's <|endoftext|> (what the LLM sends as eos_token_id)
BACKENDS = ("xgrammar", "guidance")
# No shrinking: each example runs the model, and a failure is reported with its schemas.
PROPERTY = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate))

# A small EBNF grammar (finite language) and its hand-written recognizer below.
EBNF = """root ::= pair | list
pair ::= "(" num op num ")"
list ::= "[" num ("," num)? "]"
num ::= [0-9] | [1-9] [0-9]
op ::= "+" | "-" | "*"
"""
LARK = 'start: "[" NUM ("," NUM)? "]"\nNUM: /[0-9]{1,2}/'
LARK_RE = r"\[[0-9]{1,2}(,[0-9]{1,2})?\]"
TAG_SCHEMA = {"type": "integer", "minimum": 0, "maximum": 99}
STRUCTURAL_TAG = json.dumps({"type": "structural_tag", "format": {
    "type": "tag", "begin": "<n>", "end": "</n>",
    "content": {"type": "json_schema", "json_schema": TAG_SCHEMA}}})
RECORD = {"type": "object", "required": ["n", "s", "e"], "additionalProperties": False,
          "properties": {
    "n": {"type": "integer", "minimum": -50, "maximum": 999},
    "s": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    "e": {"type": "string", "enum": ["red", "green", "blue"]}}}


# --- engines -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(model_dirs) -> Iterator[Callable[..., LLM]]:
    """LLMs on the llama test model, one per (backend, options), built on first use and
    shared by the module's tests; every test leaves all their KV blocks free."""
    created: dict[tuple[Any, ...], LLM] = {}

    def get(backend: str = "auto", **kwargs: Any) -> LLM:
        key = (backend, *sorted(kwargs.items()))
        if key not in created:
            kwargs.setdefault("kv_cache_memory_bytes", KV)
            created[key] = LLM(str(model_dirs["llama"]), multiprocess=False,
                               structured_outputs_config={"backend": backend}, **kwargs)
        return created[key]

    get.created = created  # type: ignore[attr-defined]
    yield get
    for llm in created.values():
        llm.shutdown()


@pytest.fixture(scope="module")
def cores(engines) -> Callable[[str], EngineCore]:
    """The engine core inside an in-process LLM of `engines`, stepped here directly:
    requests reach it as a foreign client sends them, with no frontend check."""

    def get(backend: str = "auto") -> EngineCore:
        return engines(backend).engine_core.core

    return get


@pytest.fixture(autouse=True)
def no_leaks(engines) -> Iterator[None]:
    yield
    for llm in engines.created.values():
        assert_no_leaks(llm)


@pytest.fixture(scope="module")
def auto(engines) -> LLM:
    return engines("auto")


def generate(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[Any]:
    """One completion per prompt (its CompletionOutput), in order."""
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def constrained(so: StructuredOutputsParams, seed: int = 0, max_tokens: int = 64,
                **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=so, **kwargs)


def run_core(core: EngineCore, requests: list[EngineCoreRequest]
             ) -> tuple[dict[str, list[int]], dict[str, EngineCoreOutput]]:
    """Add `requests` and step until nothing is left (grammars compiling included):
    each request's tokens, and its final output."""
    for r in requests:
        core.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    final: dict[str, EngineCoreOutput] = {}
    for _ in range(1000):
        if not (core.has_work() or core.num_waiting):
            break
        core.wait_for_grammars(0.05)
        for message in core.step().values():
            for o in message.all_outputs():
                tokens[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    final[o.request_id] = o
    assert set(final) == set(tokens), "a request never finished"
    return tokens, final


def wire(r: EngineCoreRequest) -> EngineCoreRequest:
    """`r` as the engine core receives it from a socket (decoding validates again)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=EngineCoreRequest)


# --- reference checks ----------------------------------------------------------------


def assert_valid_json(out: Any, schema: dict[str, Any]) -> Any:
    """`out` stopped, and its text is (strict) JSON that `schema` validates."""
    assert out.finish_reason == "stop", (out.finish_reason, out.text, schema)
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
    return value


_DIGITS = "0123456789"


def _num(s: str, i: int) -> int:
    """End of the EBNF's `num` at s[i:] (greedy: a num is never followed by a digit),
    or -1."""
    if i >= len(s) or s[i] not in _DIGITS:
        return -1
    if s[i] != "0" and i + 1 < len(s) and s[i + 1] in _DIGITS:
        return i + 2
    return i + 1


def ebnf_accepts(s: str) -> bool:
    """Hand-written recognizer of EBNF: "(" num op num ")" | "[" num ("," num)? "]"."""
    if s[:1] == "(":
        i = _num(s, 1)
        if i < 0 or s[i:i + 1] not in ("+", "-", "*"):
            return False
        j = _num(s, i + 1)
        return j > 0 and s[j:] == ")"
    if s[:1] == "[":
        i = _num(s, 1)
        if i > 0 and s[i:i + 1] == ",":
            i = _num(s, i + 1)
        return i > 0 and s[i:] == "]"
    return False


def test_the_ebnf_reference_recognizer():
    good = ["(1+2)", "(10*99)", "(0-0)", "[7]", "[12,3]", "[0,0]"]
    bad = ["", "(1+2", "(01+2)", "(1/2)", "[1,]", "[1,2,3]", "[]", "(100+1)", "[1] ", "7"]
    assert all(map(ebnf_accepts, good))
    assert not any(map(ebnf_accepts, bad))


def max_json_bytes(schema: dict[str, Any]) -> int:
    """An upper bound on the bytes of any compact instance of `schema` (the generated
    kinds only; every character of a string counted as an escaped surrogate pair and
    separators as ", " / ": "). Each token but EOS is at least one byte, so a grammar
    that enforces the schema finishes within this many tokens plus one."""
    if "enum" in schema:
        return max(2 + 12 * len(v) for v in schema["enum"])
    kind = schema["type"]
    if kind == "integer":
        return 1 + max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "boolean":
        return 5
    if kind == "string" and "pattern" in schema:
        return 2 + int(re.search(r"(\d+)}", schema["pattern"]).group(1))
    if kind == "string":
        return 2 + 12 * schema["maxLength"]
    if kind == "array":
        return 2 + schema["maxItems"] * (max_json_bytes(schema["items"]) + 2)
    return 2 + sum(len(json.dumps(k)) + 4 + max_json_bytes(v)
                   for k, v in schema["properties"].items())


# --- 1. property tests -----------------------------------------------------------------

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=5)
ENUMS = st.lists(st.text(alphabet='abcXYZ -_"\\é', min_size=1, max_size=5), min_size=1,
                 max_size=4, unique=True).map(lambda v: {"type": "string", "enum": v})
INTEGERS = st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(
    lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
BOOLEANS = st.just({"type": "boolean"})
STRINGS = st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n})
# Strings xgrammar takes ("auto" sends length-bounded ones to guidance).
PATTERNS = st.integers(0, 4).map(
    lambda n: {"type": "string", "pattern": f"^[a-z0-9]{{0,{n}}}$"})
LEAVES = st.one_of(ENUMS, INTEGERS, BOOLEANS, STRINGS, PATTERNS)
ARRAYS = st.tuples(LEAVES, st.integers(0, 3)).map(
    lambda t: {"type": "array", "items": t[0], "maxItems": t[1]})


@st.composite
def objects(draw: Any, children: Any, max_props: int) -> dict[str, Any]:
    """An object schema whose properties are `children`, a drawn subset of them
    required (at least one), and no others allowed (llguidance allows additional
    properties unless told not to: an unbounded language)."""
    props = draw(st.dictionaries(NAMES, children, min_size=1, max_size=max_props))
    names = list(props)
    required = [n for n in names if draw(st.booleans())] or names[:1]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


INNER = objects(st.one_of(LEAVES, ARRAYS), 2)
SCHEMAS = objects(st.one_of(LEAVES, ARRAYS, INNER), 3)  # nested two levels deep


@PROPERTY
@given(schemas=st.lists(SCHEMAS, min_size=2, max_size=3), seed=st.integers(0, 2**31))
def test_generated_json_schemas_on_both_backends(engines, schemas, seed):
    """Each generated schema, on "auto" (xgrammar, or guidance where it falls back) and
    on guidance, finishes with "stop" within the schema's byte bound and validates."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))]
    params = [constrained(S(json=schema, disable_any_whitespace=True), seed=seed + i,
                          max_tokens=max(200, max_json_bytes(schema) + 1))
              for i, schema in enumerate(schemas)]
    for backend in ("auto", "guidance"):
        outs = generate(engines(backend), prompts, params)
        for out, schema in zip(outs, schemas, strict=True):
            assert_valid_json(out, schema)


LITERALS = st.text(alphabet="abcxyz019_:-", min_size=1, max_size=3)
PIECES = st.one_of(
    LITERALS.map(lambda s: (s, s)),
    st.just(("\\.", ".")),  # an escaped metacharacter
    st.just(("[a-z]{1,3}", "")),
    st.just(("[0-9]{2}", "")),
    st.lists(LITERALS, min_size=2, max_size=3, unique=True).map(
        lambda alts: ("(" + "|".join(alts) + ")", "")),
)
REGEXES = st.lists(PIECES, min_size=1, max_size=4).map(lambda ps: "".join(p for p, _ in ps))
CHOICES = st.lists(st.text(alphabet='ab xyz-"\\é日{', min_size=1, max_size=5), min_size=1,
                   max_size=4, unique=True)


@PROPERTY
@given(regex=REGEXES, choice=CHOICES, seed=st.integers(0, 2**31))
def test_generated_regexes_and_choices_on_both_backends(engines, regex, choice, seed):
    """Finite languages: every output stops, the regex's fullmatches it, the choice's is
    one of the choices; two seeds each, one generate call per backend."""
    params = [constrained(S(regex=regex), seed=seed),
              constrained(S(regex=regex), seed=seed + 1),
              constrained(S(choice=choice), seed=seed),
              constrained(S(choice=choice), seed=seed + 1)]
    for backend in ("auto", "guidance"):
        outs = generate(engines(backend), PROMPTS[:4], params)
        assert all(o.finish_reason == "stop" for o in outs), outs
        for out in outs[:2]:
            assert re.fullmatch(regex, out.text), (regex, out.text)
        for out in outs[2:]:
            assert out.text in choice, (choice, out.text)


# --- 2. each kind on each backend; "auto" falls back -----------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_constraint_kind(engines, backend):
    """json (dict and text), regex, choice, Lark grammar, json_object and (xgrammar
    only) structural_tag in one batch; guidance refuses structural_tag by name."""
    llm = engines(backend)
    cases: list[tuple[StructuredOutputsParams, Callable[[str], Any]]] = [
        (S(json=RECORD, disable_any_whitespace=True),
         lambda t: jsonschema.validate(json.loads(t), RECORD)),
        (S(json=json.dumps(TAG_SCHEMA), disable_any_whitespace=True),
         lambda t: jsonschema.validate(json.loads(t), TAG_SCHEMA)),
        (S(regex=r"[a-z]{1,3}-[0-9]{2}"),
         lambda t: re.fullmatch(r"[a-z]{1,3}-[0-9]{2}", t) or pytest.fail(t)),
        (S(choice=["yes", "no", "maybe"]),
         lambda t: t in ("yes", "no", "maybe") or pytest.fail(t)),
        (S(grammar=LARK), lambda t: re.fullmatch(LARK_RE, t) or pytest.fail(t)),
    ]
    if backend == "xgrammar":
        def tag_ok(t: str) -> None:
            m = re.fullmatch(r"<n>(.*)</n>", t)
            assert m, t
            jsonschema.validate(json.loads(m.group(1)), TAG_SCHEMA)

        cases.append((S(structural_tag=STRUCTURAL_TAG), tag_ok))
    else:
        with pytest.raises(ValueError, match="structural_tag needs the xgrammar backend"):
            llm.generate("x", constrained(S(structural_tag=STRUCTURAL_TAG)), use_tqdm=False)
    # json_object: any object, so a random model may not close it in time. Seeds; the
    # stopped ones must be objects. With '}' pushed up, greedy can only give "{}".
    close = llm.tokenizer.convert_tokens_to_ids("}")
    objects_ = [constrained(S(json_object=True, disable_any_whitespace=True), seed=s,
                            max_tokens=100) for s in range(6)]
    biased = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={close: 100.0},
                            structured_outputs=S(json_object=True))
    params = [constrained(so, seed=i) for i, (so, _) in enumerate(cases)]
    outs = generate(llm, ["Hello"] * (len(params) + 7), [*params, *objects_, biased])
    for out, (so, check) in zip(outs, cases, strict=False):
        assert out.finish_reason == "stop", (so.kind, out.text, out.finish_reason)
        check(out.text)
    stopped = [o for o in outs[len(cases):-1] if o.finish_reason == "stop"]
    assert stopped, [o.text for o in outs[len(cases):-1]]
    assert all(isinstance(json.loads(o.text), dict) for o in stopped)
    assert (outs[-1].text, outs[-1].finish_reason) == ("{}", "stop")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ebnf_grammar(engines, backend):
    outs = generate(engines(backend), ["Hello"] * 6,
                    [constrained(S(grammar=EBNF), seed=s, max_tokens=20) for s in range(6)])
    for out in outs:
        assert out.finish_reason == "stop" and ebnf_accepts(out.text), out.text


def test_auto_falls_back_to_guidance_for_what_xgrammar_does_not_enforce(engines, auto):
    schema = {"type": "object", "required": ["m"], "additionalProperties": False,
              "properties": {"m": {"type": "integer", "minimum": 0, "maximum": 999,
                                   "multipleOf": 7}}}
    so = S(json=schema, disable_any_whitespace=True)
    assert choose_backend(so, "auto")[0] == "guidance"
    with pytest.raises(ValueError, match="'multipleOf', which xgrammar does not enforce"):
        engines("xgrammar").generate("x", constrained(so), use_tqdm=False)
    outs = generate(auto, PROMPTS[:8], [constrained(so, seed=s) for s in range(8)])
    values = [assert_valid_json(o, schema)["m"] for o in outs]
    assert all(v % 7 == 0 for v in values), values
    assert len(set(values)) > 1, values  # sampled, not one forced value


# --- 3. guardrails -----------------------------------------------------------------------


@pytest.mark.parametrize(("so", "named"), [
    (S(regex="("), ["parenthesis is not closed", "unclosed group"]),
    (S(json={"type": "strin"}), ['Unsupported type "strin"', "Invalid type: strin"]),
    (S(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     ["uniqueItems", "uniqueItems"]),
    (S(grammar="root ::= undefined_rule"), ["undefined_rule"]),
])
def test_a_grammar_no_backend_takes_is_refused_before_it_is_sent(auto, so, named):
    steps = auto.get_stats().num_steps
    with pytest.raises(ValueError, match=f"no backend can take this {so.kind}") as info:
        auto.generate(["fine", "x"], [SamplingParams(max_tokens=4), constrained(so)],
                      use_tqdm=False)
    for part in named:
        assert part in str(info.value)
    assert auto.get_stats().num_steps == steps  # nothing reached the engine


def test_constraint_count_and_size_bounds():
    with pytest.raises(ValueError, match=r"exactly one constraint .* got 0$"):
        S()
    with pytest.raises(ValueError, match=r"got 2: \['json', 'regex'\]"):
        S(json={"type": "integer"}, regex="a")
    with pytest.raises(ValueError, match=r"got 2: \['choice', 'json_object'\]"):
        S(choice=["a"], json_object=True)
    with pytest.raises(ValueError, match="json_object must be true"):
        S(json_object=False)
    big = {"type": "string", "description": "x" * MAX_GRAMMAR_CHARS}
    for schema in (big, json.dumps(big)):
        with pytest.raises(ValueError, match=f"structured_outputs.json is .* more than "
                                             f"{MAX_GRAMMAR_CHARS}"):
            S(json=schema)
    with pytest.raises(ValueError, match=f"regex is .* more than {MAX_GRAMMAR_CHARS}"):
        S(regex="a" * (MAX_GRAMMAR_CHARS + 1))
    with pytest.raises(ValueError, match=f"choice is .* more than {MAX_GRAMMAR_CHARS}"):
        S(choice=["ab" * 2**10] * 40)

    def nested(depth: int) -> dict[str, Any]:
        node: dict[str, Any] = {"type": "integer"}
        for _ in range(depth - 1):
            node = {"type": "array", "items": node}
        return node

    S(json=nested(MAX_SCHEMA_DEPTH))  # at the bound: taken
    for schema in (nested(MAX_SCHEMA_DEPTH + 1), json.dumps(nested(MAX_SCHEMA_DEPTH + 1)),
                   nested(500)):
        with pytest.raises(ValueError, match=f"nests deeper than {MAX_SCHEMA_DEPTH}"):
            S(json=schema)
    with pytest.raises(ValueError, match="not valid JSON"):
        S(json="{not json")


@pytest.mark.parametrize("text", [False, True])
def test_a_very_deep_schema_is_refused_by_name(text):
    schema: Any = {"type": "integer"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    # The text is built by hand: json.dumps itself recurses past Python's limit here.
    as_text = '{"items":' * 5000 + "{}" + "}" * 5000  # 50k characters: within the size
    with pytest.raises(ValueError, match=f"nests deeper than {MAX_SCHEMA_DEPTH}"):
        S(json=as_text if text else schema)


def test_free_requests_in_a_mixed_batch_are_unchanged(auto):
    """Greedy free requests give the same tokens beside constrained ones (whose bitmask
    rows must land on their own logits rows) as alone."""
    free = SamplingParams(temperature=0.0, max_tokens=16)
    alone = generate(auto, PROMPTS[:3], [free] * 3)
    sos = [S(json=RECORD, disable_any_whitespace=True), S(regex=r"[0-9]{2}-[a-z]{2}"),
           S(choice=["alpha", "beta"])]
    prompts, params = [], []
    for i in range(3):  # interleaved: constrained, free, constrained, free, ...
        prompts += [PROMPTS[5 + i], PROMPTS[i]]
        params += [constrained(sos[i], seed=i), free]
    outs = generate(auto, prompts, params)
    assert [o.token_ids for o in outs[1::2]] == [o.token_ids for o in alone]
    assert all(o.finish_reason == "length" for o in outs[1::2])
    record, pattern, choice = outs[0::2]
    assert_valid_json(record, RECORD)
    assert re.fullmatch(r"[0-9]{2}-[a-z]{2}", pattern.text) and choice.text in ("alpha", "beta")


def test_n_completions_with_a_seed(auto):
    """n=3 with seed s: three valid outputs, those of n=1 with seeds s, s+1, s+2."""
    so = S(json=RECORD, disable_any_whitespace=True)
    [result] = auto.generate("Hello", constrained(so, seed=41, n=3), use_tqdm=False)
    assert len(result.outputs) == 3
    for out in result.outputs:
        assert_valid_json(out, RECORD)
    texts = [o.text for o in result.outputs]
    singles = generate(auto, ["Hello"] * 3, [constrained(so, seed=41 + i) for i in range(3)])
    assert texts == [o.text for o in singles]
    assert len(set(texts)) > 1


def test_preempted_constrained_requests_stay_valid_and_unchanged(engines, auto):
    """A KV cache of 4 blocks (64 tokens) for 8 requests: they preempt each other and
    recompute, and each grammar (advanced only by sampled tokens) gives the same output
    as on the roomy engine."""
    block_bytes = KV // auto.info.num_kv_blocks
    tight = engines("auto", kv_cache_memory_bytes=4 * block_bytes, max_model_len=64)
    assert tight.info.num_kv_blocks == 4
    so = S(json=RECORD, disable_any_whitespace=True)
    params = [constrained(so, seed=s, max_tokens=40) for s in range(8)]
    prompts = ["Hello there, hello there"] * 8
    before = tight.get_stats().num_preemptions
    outs = generate(tight, prompts, params)
    assert tight.get_stats().num_preemptions > before
    for out in outs:
        assert_valid_json(out, RECORD)
    assert [o.token_ids for o in outs] == [o.token_ids for o in generate(auto, prompts, params)]


def test_a_foreign_clients_bad_grammar_fails_that_request_alone(cores, auto):
    """Straight to the engine core, past the frontend's check: grammars that do not
    compile fail their requests (FinishReason.ERROR, the compiler's message); a plain
    request and a good constrained one beside them complete as they would alone."""
    core = cores("auto")
    prompt = [5, 6, 7, 8]
    alone, _ = run_core(core, [request("alone", prompt, max_tokens=8, eos_token_id=EOS)])
    bad = {"paren": S(regex="("), "strin": S(json={"type": "strin"}),
           "unique": S(json={"type": "array", "uniqueItems": True})}
    requests = [wire(request(name, prompt, max_tokens=8, eos_token_id=EOS,
                             structured_outputs=so)) for name, so in bad.items()]
    requests += [request("plain", prompt, max_tokens=8, eos_token_id=EOS),
                 request("good", prompt, max_tokens=20, eos_token_id=EOS, temperature=1.0,
                         seed=3, structured_outputs=S(regex="[a-c]{2}[0-9]"))]
    tokens, final = run_core(core, requests)
    for name in bad:
        assert final[name].finish_reason == FinishReason.ERROR and tokens[name] == []
    assert "parenthesis is not closed" in final["paren"].error
    assert "strin" in final["strin"].error
    assert "uniqueItems" in final["unique"].error
    assert final["plain"].finish_reason == FinishReason.LENGTH
    assert tokens["plain"] == alone["alone"]
    assert final["good"].finish_reason == FinishReason.STOP
    text = auto.tokenizer.decode(tokens["good"], skip_special_tokens=True)
    assert re.fullmatch("[a-c]{2}[0-9]", text), text


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(cores):
    core = cores("auto")
    core.add_request(request("gone", [1, 2, 3], eos_token_id=EOS,
                             structured_outputs=S(json=RECORD)))
    assert core.num_waiting == 1
    core.abort_requests(["gone"])
    _, final = run_core(core, [request("next", [1, 2, 3], eos_token_id=EOS)])
    assert "gone" not in final and core.num_waiting == 0
    assert final["next"].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("backend", BACKENDS)
def test_min_tokens_beyond_the_grammar_fails_that_request_alone(cores, backend):
    core = cores(backend)
    prompt = [5, 6, 7, 8]
    alone, _ = run_core(core, [request("alone", prompt, max_tokens=8, eos_token_id=EOS)])
    tokens, final = run_core(core, [
        request("short", prompt, max_tokens=10, min_tokens=5, eos_token_id=EOS,
                structured_outputs=S(choice=["a"])),
        request("plain", prompt, max_tokens=8, eos_token_id=EOS)])
    assert final["plain"].finish_reason == FinishReason.LENGTH
    assert tokens["plain"] == alone["alone"]
    assert final["short"].finish_reason == FinishReason.ERROR, (final["short"], tokens)
    assert final["short"].error


def test_length_bounded_strings_exclude_control_characters(engines, auto):
    """xgrammar 0.2.8 compiles a string with minLength/maxLength to a character class
    that excludes only quote, backslash, CR and LF, admitting raw control characters
    (invalid JSON): "auto" sends such schemas to guidance, and the xgrammar backend
    refuses them by name. Greedy with the token for
    U+0000 pushed up, the output is still strict JSON."""
    schema = {"type": "object", "required": ["k"], "additionalProperties": False,
              "properties": {"k": {"type": "string", "maxLength": 3}}}
    so = S(json=schema, disable_any_whitespace=True)
    assert choose_backend(so, "auto")[0] == "guidance"
    with pytest.raises(ValueError, match="minLength/maxLength"):
        engines("xgrammar").generate("x", constrained(so), use_tqdm=False)
    nul = next(i for i in range(auto.info.vocab_size) if auto.tokenizer.decode([i]) == "\x00")
    [out] = generate(auto, ["Hello"], [SamplingParams(
        temperature=0.0, max_tokens=30, logit_bias={nul: 100.0}, structured_outputs=so)])
    assert_valid_json(out, schema)


def test_disable_additional_properties(engines):
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "boolean"}}}
    outs = generate(engines("auto"), ["Hello"] * 4, [constrained(
        S(json=schema, disable_any_whitespace=True, disable_additional_properties=True),
        seed=s) for s in range(4)])
    for out in outs:
        assert list(assert_valid_json(out, schema)) == ["a"]


def test_property_names_are_not_keywords(engines):
    schema = {"type": "object", "required": ["not", "if"], "additionalProperties": False,
              "properties": {"not": {"type": "boolean"}, "if": {"type": "integer"}}}
    so = S(json=schema, disable_any_whitespace=True)
    assert choose_backend(so, "auto")[0] == "xgrammar"
    [out] = generate(engines("xgrammar"), ["Hello"], [constrained(so)])
    assert_valid_json(out, schema)


# --- 4. logprobs under a constraint -----------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "guidance"])
def test_logprobs_see_the_grammars_mask(engines, backend):
    """The mask applies before logprobs (vLLM's order): the sampled token's logprob is
    finite, every token with a finite logprob continues a choice (or ends a complete
    one), a token outside the grammar appears only with logprob -inf ranked after them,
    and where one appears the finite ones are all the allowed and sum to probability 1."""
    llm = engines(backend)
    choices = ["yes", "no", "maybe", "y"]
    outs = generate(llm, PROMPTS[:4], [constrained(S(choice=choices), seed=s, logprobs=5)
                                       for s in range(4)])
    decode = llm.tokenizer.decode
    for out in outs:
        assert out.finish_reason == "stop" and out.text in choices
        assert len(out.logprobs) == len(out.token_ids)
        for pos, (token, position) in enumerate(zip(out.token_ids, out.logprobs,
                                                    strict=True)):
            assert math.isfinite(position[token].logprob)
            so_far = decode(out.token_ids[:pos])
            finite = {t: lp for t, lp in position.items() if math.isfinite(lp.logprob)}
            for t in finite:
                if t in EOS_TOKEN_IDS:  # the stop tokens: end a complete choice
                    assert so_far in choices, (so_far, t)
                else:
                    assert any(c.startswith(so_far + decode([t])) for c in choices), \
                        (so_far, decode([t]))
            masked = [lp for t, lp in position.items() if t not in finite]
            assert all(lp.logprob == -math.inf for lp in masked)
            if masked:
                assert min(lp.rank for lp in masked) > max(lp.rank for lp in finite.values())
                assert math.isclose(sum(math.exp(lp.logprob) for lp in finite.values()), 1,
                                    rel_tol=1e-4)


def test_chunked_prefill_and_a_cached_prefix_leave_the_output_unchanged(engines, auto):
    """A long prompt computed in 8-token chunks (no bitmask row until the request
    samples), and again from the prefix cache, samples what one whole prefill does."""
    prompt = PROMPTS[6]
    params = constrained(S(json=RECORD, disable_any_whitespace=True), seed=9,
                         max_tokens=60)
    whole = generate(auto, [prompt], [params])[0]
    chunked_llm = engines(long_prefill_token_threshold=8, max_num_batched_tokens=16)
    chunked = generate(chunked_llm, [prompt], [params])[0]
    cached = generate(chunked_llm, [prompt], [params])[0]
    assert chunked_llm.get_stats().prefix_cache_hits > 0
    assert whole.token_ids == chunked.token_ids == cached.token_ids
    jsonschema.validate(json.loads(whole.text), RECORD)


def test_a_grammar_that_does_not_compile_in_time_fails_its_request_alone(cores,
                                                                         monkeypatch):
    """The compile deadline: a request whose grammar is still compiling past it fails
    with a message; a plain request beside it completes. (The deadline is set to 0 and
    the compile held up, so the timeout is what ends it.)"""
    import threading

    from pagellm.enginecore.structured_output import manager
    from pagellm.enginecore.structured_output.backends import Backends

    core = cores("auto")
    release = threading.Event()
    original = Backends.get

    def held_up(self: Backends, name: str) -> Any:
        release.wait(10)
        return original(self, name)

    monkeypatch.setattr(manager, "COMPILE_TIMEOUT_S", 0.0)
    monkeypatch.setattr(Backends, "get", held_up)
    try:
        tokens, final = run_core(core, [
            request("slow", [5, 6, 7], max_tokens=4,
                    structured_outputs=S(regex="[a-z]+"), eos_token_id=EOS),
            request("plain", [5, 6, 7], max_tokens=4, eos_token_id=EOS)])
    finally:
        release.set()
    assert final["slow"].finish_reason == FinishReason.ERROR
    assert "did not compile within" in (final["slow"].error or "")
    assert final["plain"].finish_reason == FinishReason.LENGTH and len(tokens["plain"]) == 4


def test_sleep_and_wake_mid_request_and_priorities_keep_constrained_outputs(engines):
    """Constrained requests put to sleep mid-generation (level 1, mode "keep": their KV
    is freed and recomputed on waking; their matchers stay) and scheduled by priority
    sample exactly what an uninterrupted run does (seeded: tokens depend on nothing
    else), and match their grammar."""
    from pagellm.enginecore.core import Deferred
    from pagellm.protocol.messages import UtilityMethod

    core = engines(enable_sleep_mode=True, scheduling_policy="priority").engine_core.core
    regex = r"[a-f]{3}-[0-9]{2,6}"

    def requests(tag: str) -> list[EngineCoreRequest]:
        made = [request(f"{tag}{i}", [5 + i, 6, 7], max_tokens=12, temperature=1.0, seed=i,
                        structured_outputs=S(regex=regex), eos_token_id=EOS)
                for i in range(3)]
        for i, r in enumerate(made):
            r.priority = 2 - i  # the last added runs first
        return made

    reference, _ = run_core(core, requests("a"))
    tokens: dict[str, list[int]] = {f"b{i}": [] for i in range(3)}
    finished: set[str] = set()

    def step() -> None:
        core.wait_for_grammars(0.05)
        for message in core.step().values():
            for o in message.all_outputs():
                tokens[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    assert o.finish_reason != FinishReason.ERROR, o.error
                    finished.add(o.request_id)

    for r in requests("b"):
        core.add_request(r)
    while sum(map(len, tokens.values())) < 4:  # all three admitted and a few tokens in
        step()
    assert not finished
    sleeping = core.call_utility(UtilityMethod.SLEEP, [1, "keep"])
    assert isinstance(sleeping, Deferred)
    while not sleeping.ready():
        step()
    sleeping.finish()
    assert core.call_utility(UtilityMethod.WAKE_UP, [None]) is True
    for _ in range(200):
        if len(finished) == 3:
            break
        step()
    assert [tokens[f"b{i}"] for i in range(3)] == [reference[f"a{i}"] for i in range(3)]
    tokenizer = engines(enable_sleep_mode=True, scheduling_policy="priority").tokenizer
    for ids in tokens.values():
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert re.fullmatch(regex, text), text  # at most 11 tokens with EOS: complete
