"""Streams of many requests: one engine step is delivered to every stream in one pass,
and a consumer that falls behind gets the steps it missed as one output, with nothing
lost or reordered (frontend/output_collector.py).

The frontend-only tests feed `OutputProcessor.process_outputs` engine outputs made up
here, so every expected token list is the one fed in and every expected text is the
tokenizer's own decode of it; the end-to-end test compares with transformers.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from pagellm import AsyncLLM, RequestOutput, RequestOutputKind, SamplingParams
from pagellm.frontend import detokenizer
from pagellm.frontend.engine_client.core_client import EngineDeadError
from pagellm.frontend.input_processor import InputProcessor, ProcessedRequest
from pagellm.frontend.output_processor import OutputProcessor
from pagellm.frontend.tokenizer import load_tokenizer
from pagellm.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineInfo,
    FinishReason,
)

NUM_STREAMS = 64
NUM_STEPS = 6


@pytest.fixture(scope="module")
def tokenizer(model_dirs: Any) -> Any:
    return load_tokenizer(str(model_dirs["llama"]))


def make_streams(tokenizer: Any, kind: RequestOutputKind, n: int = 1,
                 num_streams: int = NUM_STREAMS
                 ) -> tuple[OutputProcessor, list[ProcessedRequest], list[Any]]:
    info = EngineInfo("m", 256, tokenizer.vocab_size, 16, 64, 256, "cpu", "float32")
    inputs = InputProcessor(tokenizer, info)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=n, temperature=0.0 if n == 1 else 1.0, max_tokens=NUM_STEPS,
                            output_kind=kind)
    requests = [inputs.process_inputs(f"s{i}", {"prompt_token_ids": [5 + i, 6, 7]}, params)
                for i in range(num_streams)]
    collectors = [processor.add_stream(r) for r in requests]
    return processor, requests, collectors


def token(stream: int, completion: int, step: int) -> int:
    return 300 + (stream * 7 + completion * 3 + step * 11) % 200


def step_outputs(requests: list[ProcessedRequest], step: int) -> EngineCoreOutputs:
    """Every completion of every stream samples one token; the last step finishes. As
    the engine core sends them: the first and last tokens as outputs, the others as
    the message's columns of plain tokens."""
    ids = [(engine.request_id, token(i, j, step)) for i, request in enumerate(requests)
           for j, engine in enumerate(request.engine_requests)]
    if 0 < step < NUM_STEPS - 1:
        return EngineCoreOutputs(token_req_ids=[r for r, _ in ids],
                                 token_ids=[t for _, t in ids])
    reason = FinishReason.LENGTH if step == NUM_STEPS - 1 else None
    return EngineCoreOutputs([EngineCoreOutput(r, [t], reason) for r, t in ids])


def fed(stream: int, completion: int = 0) -> list[int]:
    return [token(stream, completion, s) for s in range(NUM_STEPS)]


async def consume(collector: Any) -> list[RequestOutput]:
    """What `AsyncLLM.stream` does with its collector."""
    outputs = []
    while True:
        item = collector.get_nowait() or await collector.get()
        if isinstance(item, BaseException):
            raise item
        outputs.append(item)
        if item.finished:
            return outputs


@pytest.mark.parametrize("consumers_keep_up", [True, False])
def test_every_stream_gets_every_token_whether_or_not_its_consumer_keeps_up(
        tokenizer, consumers_keep_up):
    async def run() -> list[list[RequestOutput]]:
        processor, requests, collectors = make_streams(tokenizer, RequestOutputKind.DELTA)
        tasks = [asyncio.ensure_future(consume(c)) for c in collectors]
        await asyncio.sleep(0)  # every consumer now waits for its first output
        for step in range(NUM_STEPS):
            processor.process_outputs(step_outputs(requests, step))
            if consumers_keep_up:
                await asyncio.sleep(0)  # one pass of the loop: each consumer runs once
        return await asyncio.gather(*tasks)

    streams = asyncio.run(run())
    for i, outputs in enumerate(streams):
        # Kept up: one output per step. Behind: the steps it missed, as one output.
        assert len(outputs) == (NUM_STEPS if consumers_keep_up else 1)
        assert [t for o in outputs for t in o.outputs[0].token_ids] == fed(i)
        assert "".join(o.outputs[0].text for o in outputs) == tokenizer.decode(fed(i))
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].outputs[0].finish_reason == "length"


def test_a_behind_stream_of_n_completions_gets_one_completion_per_output(tokenizer):
    processor, requests, collectors = make_streams(tokenizer, RequestOutputKind.DELTA, n=3,
                                                   num_streams=4)
    for step in range(NUM_STEPS):
        processor.process_outputs(step_outputs(requests, step))
    for i, collector in enumerate(collectors):
        outputs = asyncio.run(consume(collector))
        assert [[c.index for c in o.outputs] for o in outputs] == [[0], [1], [2]]
        assert [o.outputs[0].token_ids for o in outputs] == [fed(i, j) for j in range(3)]
        assert [o.finished for o in outputs] == [False, False, True]  # the last one ends it


def test_cumulative_gives_the_latest_state_and_final_only_wakes_only_at_the_end(tokenizer):
    cumulative = make_streams(tokenizer, RequestOutputKind.CUMULATIVE, num_streams=2)
    final_only = make_streams(tokenizer, RequestOutputKind.FINAL_ONLY, num_streams=2)
    for processor, requests, _ in (cumulative, final_only):
        for step in range(NUM_STEPS - 1):
            processor.process_outputs(step_outputs(requests, step))
    assert cumulative[2][0].get_nowait().outputs[0].token_ids == fed(0)[:-1]
    assert cumulative[2][0].get_nowait() is None  # taken: nothing new since
    assert final_only[2][0].get_nowait() is None  # not finished: no news at all
    for processor, requests, _ in (cumulative, final_only):
        processor.process_outputs(step_outputs(requests, NUM_STEPS - 1))
    for _, _, collectors in (cumulative, final_only):
        final = collectors[1].get_nowait()
        assert final.finished and final.outputs[0].token_ids == fed(1)
        assert final.outputs[0].text == tokenizer.decode(fed(1))


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
@pytest.mark.parametrize("fold", [None, 3])
def test_stop_strings_in_streamed_text_cut_where_the_whole_text_says(
        tokenizer, kind, include, fold, monkeypatch):
    """The text is kept in pieces (every `fold` pieces joined) and streams read only
    their tail (detokenizer.py): whatever the chunking and however far behind the
    consumer is, the streamed text is the tokenizer's decode of the tokens cut at the
    stop string's first occurrence (str.find on the whole text), and nothing sent
    before the stop was found goes past that cut."""
    if fold is not None:
        monkeypatch.setattr(detokenizer, "_FOLD_PIECES", fold)
    rng = random.Random(11)
    info = EngineInfo("m", 256, tokenizer.vocab_size, 16, 64, 256, "cpu", "float32")
    inputs = InputProcessor(tokenizer, info)
    for trial in range(40):
        ids = [rng.randrange(300, 1000) for _ in range(40)]
        full = tokenizer.decode(ids)
        start = rng.randrange(len(full) - 4)
        stop = full[start:start + rng.randrange(1, 5)]
        cut = full.find(stop) + (len(stop) if include else 0)
        params = SamplingParams(temperature=0.0, max_tokens=len(ids), stop=[stop],
                                include_stop_str_in_output=include, output_kind=kind)
        processor = OutputProcessor(tokenizer)
        request = inputs.process_inputs(f"t{trial}", {"prompt_token_ids": [5, 6]}, params)
        collector = processor.add_stream(request)
        engine_id = request.engine_requests[0].request_id
        texts: list[str] = []
        i, out = 0, None
        while i < len(ids):
            n = rng.randrange(1, 4)
            chunk, i = ids[i:i + n], i + n
            reason = FinishReason.LENGTH if i >= len(ids) else None
            done = processor.process_outputs(EngineCoreOutputs([EngineCoreOutput(
                engine_id, chunk, reason)])).reqs_to_abort == [engine_id] or reason
            while (done or rng.random() < 0.5) and (out := collector.get_nowait()):
                texts.append(out.outputs[0].text)
                assert full[:cut].startswith(texts[-1] if kind == RequestOutputKind.CUMULATIVE
                                             else "".join(texts)), (stop, texts)
            if done:
                break
        assert out is None or out.finished  # the last output taken was the final one
        streamed = "".join(texts) if kind == RequestOutputKind.DELTA else texts[-1]
        assert streamed == full[:cut], (ids, stop)


def test_outputs_delivered_before_an_engine_death_come_before_its_error(tokenizer):
    processor, requests, collectors = make_streams(tokenizer, RequestOutputKind.DELTA,
                                                   num_streams=3)
    processor.process_outputs(step_outputs(requests, 0))
    processor.process_outputs(step_outputs(requests, 1))
    processor.fail_all(EngineDeadError("engine core died"))
    for i, collector in enumerate(collectors):
        first = collector.get_nowait()
        assert isinstance(first, RequestOutput)
        assert first.outputs[0].token_ids == fed(i)[:2] and not first.finished
        error = collector.get_nowait()
        assert isinstance(error, EngineDeadError) and "engine core died" in str(error)


def test_many_streams_with_slow_consumers_equal_the_reference(model_dirs, hf_reference):
    engine = AsyncLLM(str(model_dirs["llama"]), kv_cache_memory_bytes=16 * 2**20)
    prompts = ["def f(x):", "import os", "class A:", "print('hi')"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def one(i: int) -> tuple[list[int], str]:
        tokens, text = [], ""
        async for out in engine.generate(prompts[i % 4], params, f"r{i}"):
            tokens += out.outputs[0].token_ids
            text += out.outputs[0].text
            if i % 2:  # a slow consumer: the engine runs ahead of it
                await asyncio.sleep(0.01)
        return tokens, text

    async def run() -> list[tuple[list[int], str]]:
        return await asyncio.gather(*[one(i) for i in range(48)])

    try:
        results = asyncio.run(run())
    finally:
        engine.shutdown()
    tokenizer = load_tokenizer(str(model_dirs["llama"]))
    for i, (tokens, text) in enumerate(results):
        expected = hf_reference("llama", tokenizer.encode(prompts[i % 4]), 12)
        assert tokens == expected
        assert text == tokenizer.decode(expected, skip_special_tokens=True)
