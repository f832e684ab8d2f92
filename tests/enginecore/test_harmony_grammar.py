"""Structured outputs under gpt-oss's reasoning parser (openai_gptoss): the engine core
holds a request's grammar back until the model has written the token sequence of
`<|channel|>final<|message|>` (several tokens, unlike a think tag), and applies it from
the first token when the prompt's last assistant turn already reached its final message.
The reference is the tokenizer's own encoding of the tags (tests/conftest.py's
harmony_model_dir: Harmony's tags as special tokens) and the grammar's regex."""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from pagellm import SamplingParams, StructuredOutputsParams
from pagellm.enginecore.request import Request
from pagellm.enginecore.structured_output.backends import Backends
from pagellm.enginecore.structured_output.manager import StructuredOutputManager
from pagellm.protocol.reasoning import REASONING_TAGS

START, END = REASONING_TAGS["openai_gptoss"]


@pytest.fixture(scope="module")
def tokenizer(harmony_model_dir):
    return AutoTokenizer.from_pretrained(harmony_model_dir)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_tags_are_token_sequences_that_begin_with_a_special_token(harmony_model_dir,
                                                                      tokenizer):
    backends = Backends(str(harmony_model_dir), len(tokenizer), 1)
    end = backends.token_ids(END)
    assert list(end) == _ids(tokenizer, END) and len(end) > 2  # "final" is ordinary text
    assert end[0] == tokenizer.convert_tokens_to_ids("<|channel|>")
    with pytest.raises(ValueError, match="does not begin with a special token"):
        backends.token_ids("final")  # spelled out in ordinary tokens: not a tag


def _grammar_for(harmony_model_dir, tokenizer, prompt: str):
    """The grammar the engine core compiles for a request with this prompt."""
    manager = StructuredOutputManager(str(harmony_model_dir), len(tokenizer), "xgrammar",
                                      reasoning_parser="openai_gptoss")
    params = SamplingParams(max_tokens=16,
                            structured_outputs=StructuredOutputsParams(regex="[ab]{3}"))
    request = Request("r", _ids(tokenizer, prompt), params, tokenizer.eos_token_id)
    manager.submit(request)
    while not manager.has_ready():
        manager.wait(1.0)
    ((ready, error),) = manager.take_ready()
    assert error is None and ready.grammar is not None
    return ready.grammar


def test_the_grammar_waits_for_the_final_message(harmony_model_dir, tokenizer):
    """Through the analysis message, a commentary header and a final tag cut short the
    grammar neither masks nor advances; from the token that completes
    `<|channel|>final<|message|>` it does, and refuses what the regex does not allow."""
    history = "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final" \
              "<|message|>Hello<|end|><|start|>user<|message|>Again<|end|>"
    grammar = _grammar_for(harmony_model_dir, tokenizer, history + START)
    assert grammar.in_reasoning and not grammar.needs_mask  # a new turn: reasoning first
    thinking = "<|channel|>analysis<|message|>ba ba<|end|><|start|>assistant" \
               "<|channel|>commentary<|message|>x<|end|><|channel|>final<|channel|>final"
    for token in _ids(tokenizer, thinking):
        assert grammar.advance(token) is None and grammar.in_reasoning
    end = _ids(tokenizer, "<|message|>")
    assert grammar.advance(end[0]) is None and grammar.needs_mask
    a, b = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b"))
    assert grammar.advance(a) is None and grammar.advance(b) is None
    error = grammar.advance(tokenizer.convert_tokens_to_ids("c"))
    assert error is not None and re.search("not allowed by the grammar", error)


def test_a_prompt_prefilled_to_its_final_message_is_past_its_reasoning(harmony_model_dir,
                                                                       tokenizer):
    prompt = "<|start|>user<|message|>Hi<|end|>" + START + \
             "<|channel|>analysis<|message|>ok<|end|>" + START + END
    grammar = _grammar_for(harmony_model_dir, tokenizer, prompt)
    assert not grammar.in_reasoning and grammar.needs_mask


def test_gpt_oss_models_get_the_harmony_reasoning_parser_by_default(harmony_model_dir,
                                                                     tokenizer, tmp_path,
                                                                     make_llm):
    """As vLLM does for gpt-oss: with no reasoning parser configured, the engine core of
    a gpt_oss model uses openai_gptoss (reported in EngineInfo, which the server's chat
    parsers read), so a grammar waits for the final message: a prompt that opens a new
    turn is sampled freely, one prefilled to its final message is constrained at once.
    Neither the llama model with the same tokenizer nor the gpt_oss model with a
    tokenizer that has no Harmony tags gets the parser."""
    import shutil

    from family_specs import FAMILY_SPECS

    from pagellm.demo.model import make_model

    model = make_model(tmp_path / "gpt_oss", FAMILY_SPECS["gpt_oss"])
    # its own tokenizer has no Harmony tags: such a model does not write Harmony
    assert make_llm(model).info.reasoning_parser is None
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(harmony_model_dir / name, model / name)
    llm = make_llm(model)
    assert llm.info.reasoning_parser == "openai_gptoss"
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=2,
                            structured_outputs=StructuredOutputsParams(regex="[ab]{3}"))
    turn = "<|start|>user<|message|>Hi<|end|>" + START
    free = llm.generate({"prompt_token_ids": _ids(tokenizer, turn)}, params,
                        use_tqdm=False)[0].outputs
    assert not all(re.fullmatch("[ab]{3}", o.text) for o in free)  # not constrained yet
    prefilled = llm.generate({"prompt_token_ids": _ids(tokenizer, turn + END)}, params,
                             use_tqdm=False)[0].outputs
    assert all(re.fullmatch("[ab]{3}", o.text) for o in prefilled), prefilled
    assert make_llm(harmony_model_dir).info.reasoning_parser is None


@pytest.mark.parametrize(("config", "added", "expected"), [
    ({"added_tokens_decoder": {"200005": {"content": "<|channel|>", "special": True}}}, [],
     "openai_gptoss"),  # as gpt-oss's own files declare it
    ({"added_tokens_decoder": {"200005": {"content": "<|channel|>", "special": False}}}, [],
     None),
    ({"extra_special_tokens": ["<|channel|>"]}, [], "openai_gptoss"),  # transformers 5
    ({}, [{"id": 7, "content": "<|channel|>", "special": True}], "openai_gptoss"),
    ({}, [{"id": 7, "content": "<|message|>", "special": True}], None)])
def test_the_default_reads_the_tokenizers_own_files(tmp_path, config, added, expected):
    import json

    from pagellm.protocol.reasoning import effective_reasoning_parser

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    assert effective_reasoning_parser(None, "gpt_oss", str(tmp_path)) == expected
    assert effective_reasoning_parser(None, "llama", str(tmp_path)) is None
    assert effective_reasoning_parser("qwen3", "gpt_oss", str(tmp_path)) == "qwen3"
    assert effective_reasoning_parser(None, "gpt_oss", None) is None  # no tokenizer
