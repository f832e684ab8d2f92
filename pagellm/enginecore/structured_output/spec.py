"""What a request's `StructuredOutputsParams` asks for, as one grammar text of one
kind, and which backend can compile it.

Both backends are real grammar engines (xgrammar, llguidance); this module only puts
each constraint in the form they take and decides between them, with vLLM's "auto"
rule: xgrammar first, llguidance for what xgrammar does not support, an error naming
the unsupported feature when neither does. The frontend runs the same choice before a
request leaves it (a 400 instead of a failed request later), and the engine core runs
it again in its compile thread (it also serves clients we did not write); results are
cached by the grammar's text, so the second time costs a dictionary lookup.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from pagellm.protocol.sampling_params import StructuredOutputsParams

BACKENDS = ("auto", "xgrammar", "guidance")
# String formats xgrammar's JSON-schema converter implements (others it ignores).
XGRAMMAR_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Keywords xgrammar accepts but does not enforce: a schema using them goes to
# llguidance (or is refused), never silently loosened.
XGRAMMAR_IGNORED = ("multipleOf", "uniqueItems", "contains", "minContains", "maxContains",
                    "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                    "unevaluatedProperties", "unevaluatedItems", "propertyNames",
                    "patternProperties")

_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class UnsupportedGrammar(ValueError):
    """A backend cannot take this constraint; the message names what it lacks."""


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint in the form the backends compile. kind: "json" (a JSON schema's
    text), "regex", "ebnf", "lark" or "structural_tag"; the text is the cache key."""

    kind: str
    text: str
    any_whitespace: bool = True

    @classmethod
    def of(cls, params: StructuredOutputsParams, any_whitespace: bool = True) -> GrammarSpec:
        """`any_whitespace`: the engine's default (structured_outputs_config), which a
        request's disable_any_whitespace turns off."""
        ws = any_whitespace and not params.disable_any_whitespace
        extra = not params.disable_additional_properties
        kind = params.kind
        if kind in ("json", "json_object"):
            schema: Any = params.json if kind == "json" else {"type": "object"}
            if not extra:  # vLLM's rewrite: objects that allow no other keys
                schema = _no_additional_properties(
                    json.loads(schema) if isinstance(schema, str) else schema)
            return cls("json", schema if isinstance(schema, str) else json.dumps(schema), ws)
        if kind == "choice":  # one literal per choice, JSON-escaped (EBNF and Lark both)
            assert params.choice is not None
            return cls("lark", "start: " + " | ".join(map(json.dumps, params.choice)))
        if kind == "grammar":
            assert params.grammar is not None
            return cls("ebnf" if "::=" in params.grammar else "lark", params.grammar)
        if kind == "regex":
            assert params.regex is not None
            if "\x00" in params.regex:  # never meaningful; xgrammar's converter mishandles it
                raise ValueError("structured_outputs.regex must not contain a NUL character")
            return cls("regex", params.regex)
        assert params.structural_tag is not None
        return cls("structural_tag", params.structural_tag)


def choose_backend(params: StructuredOutputsParams, configured: str,
                   any_whitespace: bool = True) -> tuple[str, GrammarSpec]:
    """(the backend that will compile it, the spec). `configured` is the engine's
    backend; with "auto" (and no disable_fallback) xgrammar, else llguidance. Raises
    ValueError naming what is unsupported (or malformed) for the backends tried."""
    spec = GrammarSpec.of(params, any_whitespace)
    if configured != "auto":
        check(configured, spec)
        return configured, spec
    try:
        check("xgrammar", spec)
        return "xgrammar", spec
    except UnsupportedGrammar as first:
        if params.disable_fallback:
            raise UnsupportedGrammar(f"xgrammar: {first}") from None
        try:
            check("guidance", spec)
        except UnsupportedGrammar as second:
            raise UnsupportedGrammar(f"structured_outputs: no backend can take this "
                                     f"{params.kind}: xgrammar: {first}; guidance: "
                                     f"{second}") from None
        return "guidance", spec


def check(backend: str, spec: GrammarSpec) -> None:
    """UnsupportedGrammar unless `backend` can compile `spec` (no tokenizer needed)."""
    error = _check(backend, spec)
    if error is not None:
        raise UnsupportedGrammar(error)


@functools.lru_cache(maxsize=512)
def _check(backend: str, spec: GrammarSpec) -> str | None:
    """The error, or None; cached (bounded) because the frontend and the engine both
    ask, and agents send the same few schemas again and again."""
    try:
        if backend == "xgrammar":
            _check_xgrammar(spec)
        elif backend == "guidance":
            _check_guidance(spec)
        else:
            return f"unknown structured outputs backend {backend!r} (choose from {BACKENDS})"
    except UnsupportedGrammar as e:
        return str(e)
    except Exception as e:  # the libraries' own errors: the grammar is malformed
        return f"{type(e).__name__}: {_first_line(e)}"
    return None


def _first_line(e: BaseException) -> str:
    """The library's message without xgrammar's "[time] file.cc:line: " prefix."""
    text = _NATIVE_PREFIX.sub("", str(e).strip())
    return text.splitlines()[0][:500] if text else type(e).__name__


def _check_xgrammar(spec: GrammarSpec) -> None:
    import xgrammar as xgr

    if spec.kind == "json":
        unsupported = xgrammar_unsupported(json.loads(spec.text))
        if unsupported:
            raise UnsupportedGrammar(f"the JSON schema uses {unsupported}, which xgrammar "
                                     "does not enforce")
        xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace)
    elif spec.kind == "regex":
        xgr.Grammar.from_regex(spec.text)
    elif spec.kind == "ebnf":
        xgr.Grammar.from_ebnf(spec.text)
    elif spec.kind == "lark":
        xgr.Grammar.from_lark(spec.text)
    else:
        xgr.Grammar.from_structural_tag(spec.text)


def _check_guidance(spec: GrammarSpec) -> None:
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(guidance_grammar(spec))
    if is_error:
        raise UnsupportedGrammar("; ".join(messages)[:500] or "invalid grammar")


@functools.lru_cache(maxsize=512)
def guidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar for `spec` (its JSON form, which LLMatcher takes)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if spec.kind == "json":
        options: Any = {"whitespace_flexible": spec.any_whitespace}
        return str(LLMatcher.grammar_from_json_schema(spec.text, defaults=options))
    if spec.kind == "regex":
        return str(LLMatcher.grammar_from_regex(spec.text))
    if spec.kind == "lark":
        return str(LLMatcher.grammar_from_lark(spec.text))
    if spec.kind == "ebnf":
        return str(LLMatcher.grammar_from_lark(gbnf_to_lark(spec.text)))
    raise UnsupportedGrammar("structural_tag needs the xgrammar backend")


# Keywords whose value is a map of names to subschemas; and those whose value is a
# subschema, or a list of them. Other keywords' values are data (enum, const, ...).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties",
               "additionalItems", "anyOf", "allOf", "oneOf", "prefixItems")


def subschemas(node: dict[str, Any]) -> list[dict[str, Any]]:
    """The schemas directly inside a schema node (a property named "not" is a name,
    not the keyword)."""
    found: list[Any] = []
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            found += value.values()
        elif key in _SUBSCHEMAS:
            found += value if isinstance(value, list) else [value]
    return [v for v in found if isinstance(v, dict)]


def _no_additional_properties(schema: Any) -> Any:
    """A copy of `schema` where every object schema without additionalProperties (or
    unevaluatedProperties) allows no keys beyond its properties."""
    if not isinstance(schema, dict):
        return schema
    out = {key: ({name: _no_additional_properties(v) for name, v in value.items()}
                 if key in _SCHEMA_MAPS and isinstance(value, dict)
                 else [_no_additional_properties(v) for v in value]
                 if key in _SUBSCHEMAS and isinstance(value, list)
                 else _no_additional_properties(value) if key in _SUBSCHEMAS
                 else value)
           for key, value in schema.items()}
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out and \
            "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def xgrammar_unsupported(schema: Any) -> str | None:
    """The first feature of `schema` that xgrammar would not enforce, named ("keyword
    'uniqueItems'", "format 'weird'"), or None. Walks the whole schema iteratively (its
    depth was bounded when the request arrived)."""
    stack = [schema] if isinstance(schema, dict) else []
    while stack:
        node = stack.pop()
        for keyword in XGRAMMAR_IGNORED:
            if keyword in node and not (keyword == "propertyNames" and node[keyword] is True):
                return f"keyword {keyword!r}"
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in XGRAMMAR_FORMATS:
            return f"format {fmt!r}"
        if "minLength" in node or "maxLength" in node:
            # xgrammar 0.2.8's length-bounded strings admit raw control characters
            # (invalid JSON), and with a pattern or format it drops the bounds.
            return "minLength/maxLength on a string"
        stack.extend(subschemas(node))
    return None
