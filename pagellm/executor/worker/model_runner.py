"""The model runner: turns a `SchedulerOutput` into one forward pass and sampled ids.

Per-request state persists between steps in an `InputBatch` (vLLM's persistent
batch): token ids, block table and progress arrive once, then only changes; tokens it
samples are appended to its own copy, so a decode step needs no token ids from the
scheduler. Each step's flat, unpadded batch (input ids, positions, slot mapping, block
tables, ...) is built by `InputPreparer` (step_inputs.py) and staged through
`StepBuffers` (pinned host memory, non-blocking copies into device buffers allocated
once), so the step's one wait on the device is for its sampled ids. Steps where every
request computes one token replay a CUDA graph (`DecodeGraphs`) on those same buffers,
padded to the next captured batch size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np
import torch

from pagellm.executor.lora.manager import LoRAManager, LoRASettings
from pagellm.executor.model.attention import (
    AttentionMetadata,
    get_attention_backend,
    num_kv_segments,
)
from pagellm.executor.model.config import ModelConfig
from pagellm.executor.model.linear import INT_WEIGHTS, drop_packed
from pagellm.executor.model.loader import load_model
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.worker.cpu_decode import CpuDecodeStep
from pagellm.executor.worker.cpu_threads import ThreadTuner, tunable_threads
from pagellm.executor.worker.cuda_graphs import DecodeGraphs, capture_sizes
from pagellm.executor.worker.draft_model import DraftModel
from pagellm.executor.worker.grammar_mask import apply_grammar_bitmask
from pagellm.executor.worker.input_batch import InputBatch
from pagellm.executor.worker.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    gather_logprobs,
    log_probs,
)
from pagellm.executor.worker.sampling_inputs import sampling_metadata, to_device
from pagellm.executor.worker.step_buffers import StepBuffers
from pagellm.executor.worker.step_inputs import InputPreparer, StepInputs
from pagellm.kernels import cpu_int_gemm
from pagellm.protocol.messages import TokenLogprobs
from pagellm.protocol.sampling_params import SamplingParams
from pagellm.protocol.scheduling import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobsChunk,
    SchedulerOutput,
)

logger = logging.getLogger("pagellm")

# Prompt positions whose logprobs are computed at once (bounds the [positions, vocab]
# logits a long prompt chunk would otherwise materialize).
PROMPT_LOGPROBS_SLICE = 256


def verify_proposals(samples: np.ndarray, proposals: np.ndarray) -> np.ndarray:
    """samples [k + 1] (at the last token's position and each proposal's), proposals
    [k] -> the tokens emitted: the proposals the samples agree with, in a row, then the
    sample where they first disagree (or the last sample). See `ModelRunner._verify`."""
    k = len(proposals)
    accepted = int((samples[:k] == proposals).cumprod().sum()) if k else 0
    return samples[:accepted + 1]


def _bytes(tensors: Iterable[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """What tensors of these (shape, dtype) take."""
    return sum(int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in tensors)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, device: torch.device, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, seed: int,
                 attention_backend: str = "auto", logprobs_mode: str = "raw_logprobs",
                 tp: TensorParallel | None = None, host_ranks: int = 1,
                 lora: LoRASettings | None = None, draft: ModelConfig | None = None,
                 num_speculative_tokens: int = 0) -> None:
        """`host_ranks`: the workers sharing this host's memory (the loader's share).
        `lora`: serve LoRA adapters (`self.lora`, executor/lora/manager.py). `draft`:
        speculative decoding's draft model, proposing `num_speculative_tokens`
        (`self.drafter`, draft_model.py)."""
        self.model_config = model_config
        # This rank's slice of the model (all of it without tensor parallelism).
        self.tp = tp or TensorParallel.layout(model_config.spec)
        self.num_kv_heads = self.tp.num_kv_heads
        self.processed_logprobs = logprobs_mode == "processed_logprobs"
        self.device = device
        self.block_size = block_size
        self.attention = get_attention_backend(attention_backend, device, block_size,
                                               model_config.cache_dtype,
                                               model_config.spec.head_dim)
        if self.attention.name == "triton":
            from pagellm.kernels.triton_attention import SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_SIZES

            if block_size not in SUPPORTED_BLOCK_SIZES:
                raise ValueError(f"block_size={block_size} is not supported by the Triton "
                                 f"attention kernels (supported: {SUPPORTED_BLOCK_SIZES})")
            if model_config.spec.head_dim not in SUPPORTED_HEAD_SIZES:
                raise ValueError(f"head_dim={model_config.spec.head_dim} is not supported by "
                                 f"the Triton attention kernels ({SUPPORTED_HEAD_SIZES}); use "
                                 "attention_backend='torch'")
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 0)
        if model_config.cache_dtype == torch.float8_e4m3fn and device.type == "cuda" \
                and torch.cuda.get_device_capability(device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(device)
            raise ValueError(f"kv_cache_dtype='fp8' needs an Ada or Hopper GPU (compute "
                             f"capability 8.9 or newer: e4m3 conversions); this one is "
                             f"{major}.{minor}")
        if model_config.quantization is not None:
            self._check_quantization(model_config.quantization)
        self.model = load_model(model_config, device, self.tp, host_ranks,
                                kernels=self.attention.name == "triton")
        if model_config.checkpoint_quant is not None:
            logger.info("%s checkpoint: %s", model_config.checkpoint_quant.method,
                        f"{len(self.model.quantized)} projections packed"
                        if self.model.quantized else "loaded dequantized (its kernels are "
                        "Triton's: CUDA, or attention_backend='triton')")
        if model_config.quantization is not None:
            logger.info("quantization=%s: %d weights quantized on load",
                        model_config.quantization, len(self.model.quantized))
        if self.attention.name != "triton" and self.model.quantized:
            # An int8 copy of the LM head (the CPU int kernel's), as llama.cpp's Q4_0 /
            # Q8_0 files keep theirs: at batch 1 the fp32 head was a fifth of an int4 step.
            INT_WEIGHTS.pack([self.model.head_weight])
        self.lora = None if lora is None else LoRAManager(
            self.model, model_config.spec, self.tp, lora, model_config.dtype, device,
            kernels=self.attention.name == "triton")
        # Decode steps in one C++ call on the CPU where the model allows (cpu_decode.py).
        self.cpu_decode = None if device.type != "cpu" else CpuDecodeStep.for_model(
            self.model, model_config.dtype, model_config.cache_dtype, self.attention.name,
            self.lora is not None)
        self.drafter = None if draft is None else DraftModel(
            draft, num_speculative_tokens, device, self.tp, host_ranks, self.attention,
            block_size, self.num_sms, max_num_seqs, max_num_batched_tokens)
        self.sampler = Sampler(device, seed)
        self.max_num_seqs = max_num_seqs
        # Per layer that keeps a state per request (lfm2.py, qwen3_5.py), its
        # [max_num_seqs, ...] shape and dtype: a request's batch row is its state's row.
        self.state_shapes = self.model.state_shapes(max_num_seqs)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.batch = InputBatch(max_num_seqs, model_config.max_model_len, block_size,
                                model_config.vocab_size)
        tokens = max(max_num_batched_tokens, max_num_seqs)
        max_blocks = self.batch.block_table.shape[1]
        shapes = {
            "input_ids": ((tokens,), torch.int64), "positions": ((tokens,), torch.int64),
            "slot_mapping": ((tokens,), torch.int64),
            "block_tables": ((max_num_seqs, max_blocks), torch.int32),
            "query_start_loc": ((max_num_seqs + 1,), torch.int32),
            "seq_lens": ((max_num_seqs,), torch.int32),
            "logits_indices": ((max_num_seqs,), torch.int64),
            "temperature": ((max_num_seqs,), torch.float32),
            "top_k": ((max_num_seqs,), torch.int64), "top_p": ((max_num_seqs,), torch.float32),
            "min_p": ((max_num_seqs,), torch.float32)}
        if self.lora is not None and self.lora.batch.kernels:  # (slot, start, end) runs
            shapes["lora_runs"] = ((self.lora.max_loras, 3), torch.int32)
        self.buffers = StepBuffers(device, shapes)
        if "lora_runs" in shapes:
            assert self.lora is not None
            self.lora.batch.device_runs = self.buffers.device_buffers["lora_runs"]
        self.graphs: DecodeGraphs | None = None
        self.inputs = InputPreparer(self.batch, self.buffers, self.attention, block_size,
                                    max_num_seqs, self.num_kv_heads, self.num_sms,
                                    self.lora)
        self.kv_caches: list[torch.Tensor] = []
        # On the CPU, each step size's thread count is measured (cpu_threads.py).
        self.thread_tuner = (ThreadTuner(torch.get_num_threads())
                             if device.type == "cpu" and tunable_threads() else None)

    def weights_changed(self) -> None:
        """The weights were written or replaced in ways no version counter sees (a weight
        update, sleep, collective_rpc): drop what is kept of them, the CPU's packed copies
        and the fused decode step's tensor lists; the next step makes them again."""
        drop_packed()
        if self.cpu_decode is not None:
            self.cpu_decode.forget()

    def _check_quantization(self, quantization: str) -> None:
        """Quantize-on-load (the loader quantizes while loading: executor/model/
        quantize.py) runs the Triton kernels where the attention runs Triton's: on CUDA
        (on the CPU attention_backend='triton' runs them anyway, for tests). The CPU's
        own path takes int4 and int8, through its C++ int kernel
        (kernels/cpu_int_gemm.py: faster than fp32 where the CPU has AVX-512 VNNI's int8
        dot products), the MoE experts packed on both paths (moe.py; not for fp8), and,
        as for an integer checkpoint there, the LM head from an int8 copy of its weight
        (linear.INT_WEIGHTS, made again after weight updates; registered in __init__);
        it has no fp8 GEMM faster than fp32's: refused before anything loads."""
        triton = self.attention.name == "triton"
        if not triton and quantization == "fp8":
            raise ValueError("quantization='fp8' needs CUDA (the CPU has no fp8 GEMM faster "
                             "than fp32's; it takes 'int4' and 'int8'. "
                             "attention_backend='triton' runs it anyway, for tests)")
        if not triton and not cpu_int_gemm.fast_on_this_cpu():
            logger.warning("quantization=%r on a CPU without AVX-512 VNNI: less memory "
                           "than fp32, but slower", quantization)

    # -- KV cache ------------------------------------------------------------------

    def _kv_cache_shapes(self, num_blocks: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Each model's cache, [layers, K|V (or one plane), blocks, block_size, kv_heads,
        head_dim], and
        its dtype: the target's, then the draft model's (speculative decoding), which
        shares the target's block ids."""
        models = [(self.model_config, self.num_kv_heads)]
        if self.drafter is not None:
            models.append((self.drafter.config, self.drafter.tp.num_kv_heads))
        return [((config.spec.num_kv_layers, config.spec.kv_planes, num_blocks,
                  self.block_size, kv_heads, config.spec.head_dim), config.cache_dtype)
                for config, kv_heads in models]

    def state_bytes(self) -> int:
        """What the layers that keep a state per request (`state_shapes`) take, for every
        row of the batch: allocated with the KV cache, out of its budget."""
        return _bytes(self.state_shapes.values())

    def kv_cache_bytes_per_block(self) -> int:
        return _bytes(self._kv_cache_shapes(1))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        # One list of layers: the target's, then the draft's (`drafter.num_layers`). Not
        # zeroed (on the CPU pages are committed as blocks get used): no kernel reads a
        # slot its request has not written.
        # Each layer's [K|V, ...]: a cache of one plane (spec.kv_planes: DeepSeek's
        # latent is its own value) is expanded to two views of the same memory, so that
        # every backend reads and writes it as any cache.
        # A layer that keeps a state per request instead (`state_shapes`) has that in its
        # place, one row per batch row.
        caches = iter([layer.expand(2, *layer.shape[1:])
                       for shape, dtype in self._kv_cache_shapes(num_blocks)
                       for layer in torch.empty(shape, dtype=dtype,
                                                device=self.device).unbind(0)])
        states = self.state_shapes
        self.kv_caches = [torch.zeros(states[i][0], dtype=states[i][1], device=self.device)
                          if i in states else next(caches)
                          for i in range(self.model_config.spec.num_layers)]
        self.kv_caches += list(caches)  # the draft model's

    # -- start-up: profiling and CUDA graphs ---------------------------------------

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Run the largest step the scheduler can make (max_num_batched_tokens prompt
        tokens over up to max_num_seqs requests, every one sampling with top-k and
        top-p and returning raw logprobs) through the real step path, on a scratch KV
        cache just big enough. Returns its peak activation memory in bytes on CUDA (0 on
        the CPU, where `sampler.step_peak_bytes` stands in for the logits), which the
        executor leaves free when it sizes the KV cache."""
        max_len, bs = self.model_config.max_model_len, self.block_size
        # The scheduler never runs more than max_num_seqs full-length requests at once.
        tokens = min(self.max_num_batched_tokens, self.max_num_seqs * max_len)
        reqs = max(min(self.max_num_seqs, tokens), -(-tokens // max_len))
        lengths = [tokens // reqs + (i < tokens % reqs) for i in range(reqs)]
        first_block = np.cumsum([0] + [-(-n // bs) for n in lengths]).tolist()
        saved_caches = self.kv_caches
        self.initialize_kv_cache(first_block[-1])
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1, logprobs=1)
        vocab = self.model_config.vocab_size
        new = [NewRequestData(f"profile-{i}", [(i + j) % vocab for j in range(n)], [], params,
                              None, list(range(first_block[i], first_block[i + 1])), 0)
               for i, n in enumerate(lengths)]
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            baseline = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.execute_model(SchedulerOutput(
            new, CachedRequestData.empty(), {r.req_id: len(r.prompt_token_ids) for r in new},
            tokens, [], []))
        peak = torch.cuda.max_memory_allocated(self.device) - baseline if cuda else 0
        for request in new:
            self.batch.remove(request.req_id)
        self.kv_caches = saved_caches
        if cuda:
            torch.cuda.empty_cache()
        return peak

    def capture_cuda_graphs(self) -> tuple[int, float]:
        """Capture the decode forward pass at every size of the ladder (after the KV
        cache exists: the graphs hold its address). Returns (graphs, seconds)."""
        assert self.device.type == "cuda" and self.kv_caches, "needs CUDA and a KV cache"
        assert self.attention.name == "triton", "graphs need the Triton attention backend"
        sizes = capture_sizes(self.max_num_seqs)
        self.stage_padding(sizes[-1])
        self.graphs = DecodeGraphs(sizes)
        with torch.inference_mode():
            seconds = self.graphs.capture(self._decode_forward)
        return len(sizes), seconds

    def stage_padding(self, size: int) -> None:
        """Fill the first `size` rows of the step buffers with padding requests, the
        inputs graphs are captured on: no KV writes (slot -1), no keys read (length 0)."""
        put = self.buffers.put
        self.buffers.begin_step()
        for name, fill in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1),
                           ("block_tables", 0), ("seq_lens", 0)):
            put(name, np.zeros(0, np.int64), fill, size)
        put("query_start_loc", np.arange(size + 1))
        if "lora_runs" in self.buffers.host:  # no adapter runs
            put("lora_runs", np.zeros((0, 3), np.int32), 0,
                self.buffers.host["lora_runs"].shape[0])
        self.buffers.end_step()

    def _decode_forward(self, size: int) -> torch.Tensor:
        """The forward pass a decode graph records: `size` one-token requests read from
        the step buffers -> hidden [size, H] (logits come after the graph). A graph
        always runs the LoRA kernels, on whatever runs its step staged (none: no work)."""
        buf = self.buffers.device_buffers
        if self.lora is not None:
            self.lora.batch.launch = True
        meta = AttentionMetadata(
            slot_mapping=buf["slot_mapping"][:size], block_tables=buf["block_tables"][:size],
            query_start_loc=buf["query_start_loc"][:size + 1], seq_lens=buf["seq_lens"][:size],
            query_start_loc_cpu=np.zeros(1, np.int64), seq_lens_cpu=np.zeros(0, np.int64),
            max_query_len=1, backend=self.attention,
            # Fixed at capture, for the longest context the graph may meet.
            num_segments=num_kv_segments(size, self.num_kv_heads, 1,
                                         self.model_config.max_model_len, self.num_sms))
        return self.model(buf["input_ids"][:size], buf["positions"][:size], meta,
                          self.kv_caches)

    # -- one step ------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        tuner = self.thread_tuner
        if tuner is None or scheduler_output.is_empty:
            return self._execute(scheduler_output)
        threads = tuner.threads_for(scheduler_output.total_num_scheduled_tokens)
        before = torch.get_num_threads()  # an in-process engine leaves its host's as found
        if threads != before:
            torch.set_num_threads(threads)
        try:
            output = self._execute(scheduler_output)
        finally:
            if threads != before:
                torch.set_num_threads(before)
        tuner.record(output.forward_s + output.sample_s)
        return output

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput([], [])
        inputs = self.inputs.prepare(scheduler_output, self.graphs)
        t1 = time.perf_counter()
        if inputs.graph_size is not None and self.graphs is not None:
            hidden = self.graphs.replay(inputs.graph_size)  # [padded size, H]
        elif self.cpu_decode is not None and self.cpu_decode.takes(inputs.meta.max_query_len):
            hidden = self.cpu_decode(inputs.input_ids, inputs.positions, inputs.meta,
                                     self.kv_caches)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [S, V]
        if scheduler_output.grammar is not None:  # structured outputs: mask first
            row_of: dict[str, int] = {}  # each request's first sampled row
            for row, i in enumerate(inputs.sample_req.tolist()):
                row_of.setdefault(inputs.req_ids[i], row)
            apply_grammar_bitmask(logits, scheduler_output.grammar, row_of)
        t2 = time.perf_counter()
        drafts = scheduler_output.propose_drafts and self.drafter is not None
        sampled_token_ids: list[int]  # per request; -1: samples nothing this step
        logprobs: dict[str, TokenLogprobs] = {}
        if len(inputs.sampling):
            meta = sampling_metadata(self.batch, inputs.sampling_rows, self.buffers,
                                     self.processed_logprobs, inputs.sample_offsets)
            out = self.sampler(logits, meta)
            # The step's one host sync; it also means every input copy is done.
            sampled_np = out.sampled.cpu().numpy()
            if inputs.num_drafts is not None:  # speculative decoding: verify proposals
                return self._output(inputs, *self._verify(inputs, sampled_np, meta,
                                                          out.logprobs), t0, t1, t2, hidden,
                                    drafts)
            self.batch.append_tokens(inputs.sampling_rows, sampled_np)
            if len(inputs.sampling) == len(inputs.req_ids):  # every request samples
                sampled_token_ids = sampled_np.tolist()
            else:
                sampled_token_ids = [-1] * len(inputs.req_ids)
                for i, token_id in zip(inputs.sampling.tolist(), sampled_np.tolist(),
                                       strict=True):
                    sampled_token_ids[i] = token_id
            if out.logprobs is not None and meta.logprob_rows is not None:
                logprobs = self._logprobs_by_request(inputs, meta.logprob_rows, out.logprobs)
        else:  # nothing to wait for: the next step must check its copies are done
            sampled_token_ids = [-1] * len(inputs.req_ids)
            self.buffers.end_step()
        return self._output(inputs, sampled_token_ids, logprobs, {}, {}, t0, t1, t2, hidden,
                            drafts)

    def _output(self, inputs: StepInputs, sampled_token_ids: list[int],
                logprobs: dict[str, TokenLogprobs], more_token_ids: dict[str, list[int]],
                more_logprobs: dict[str, list[TokenLogprobs]], t0: float, t1: float,
                t2: float, hidden: torch.Tensor, drafts: bool) -> ModelRunnerOutput:
        """`drafts`: the draft model proposes the sampling requests' next tokens."""
        draft_token_ids: dict[str, list[int]] = {}
        if drafts:
            assert self.drafter is not None
            draft_token_ids = self.drafter.propose_after(
                inputs, self.batch, self.kv_caches[self.model_config.spec.num_layers:])
        prompt_logprobs = self._prompt_logprobs(hidden, inputs) \
            if self.batch.num_prompt_logprobs else {}
        t3 = time.perf_counter()
        collective_s, self.tp.collective_s = self.tp.collective_s, 0.0
        return ModelRunnerOutput(inputs.req_ids, sampled_token_ids, logprobs, prompt_logprobs,
                                 prepare_inputs_s=t1 - t0, forward_s=t2 - t1,
                                 sample_s=t3 - t2, collective_s=collective_s,
                                 attention_plan_s=inputs.attention_plan_s,
                                 more_token_ids=more_token_ids, more_logprobs=more_logprobs,
                                 draft_token_ids=draft_token_ids)

    def _verify(self, inputs: StepInputs, sampled: np.ndarray, meta: SamplingMetadata,
                tensors: LogprobsTensors | None
                ) -> tuple[list[int], dict[str, TokenLogprobs], dict[str, list[int]],
                           dict[str, list[TokenLogprobs]]]:
        """Speculative decoding's verification: `sampled` [S'] holds, for each request
        that samples, a sample at its last token's position and at each of its k
        proposals' positions, each drawn as a step without proposals would have drawn it
        there (sampling_metadata's offsets). The request keeps the proposals up to the
        first the samples disagree with, then that sample (or, all accepted, the sample
        after the last). Each emitted token is thus the sample at its position given the
        tokens before it, which is how one-token steps sample: the same tokens for
        greedy and seeded requests, the same distribution for the rest (an n-gram
        proposal is one token, q one-hot: accepting it when p's sample equals it, with
        probability p(d), and else keeping that sample, drawn from p without d, is
        rejection sampling's min(1, p/q) rule with its residual).

        Returns per request (-1 where nothing samples) the first emitted token, and the
        logprobs, further tokens and their logprobs, by request id; the batch's token
        rows take every emitted token."""
        batch = self.batch
        assert inputs.num_drafts is not None
        req_ids, counts = inputs.req_ids, inputs.num_drafts.tolist()
        by_row = {} if tensors is None or meta.logprob_rows is None else \
            self._logprobs_rows(inputs, meta.logprob_rows, tensors)
        first: list[int] = [-1] * len(req_ids)
        logprobs: dict[str, TokenLogprobs] = {}
        more: dict[str, list[int]] = {}
        more_logprobs: dict[str, list[TokenLogprobs]] = {}
        at = 0
        for i, k in zip(inputs.sampling.tolist(), counts, strict=True):
            row = int(inputs.rows[i])
            end = int(batch.num_tokens[row])
            emitted = verify_proposals(sampled[at:at + k + 1], batch.token_ids[row, end:end + k])
            accepted = len(emitted) - 1
            batch.token_ids[row, end:end + accepted + 1] = emitted
            batch.num_tokens[row] = end + accepted + 1
            req_id = req_ids[i]
            first[i] = int(emitted[0])
            if accepted:
                more[req_id] = emitted[1:].tolist()
            if at in by_row:  # it asked for logprobs
                lps = [by_row[j] for j in range(at, at + accepted + 1)]
                logprobs[req_id] = lps[0]
                if accepted:
                    more_logprobs[req_id] = lps[1:]
            at += k + 1
        return first, logprobs, more, more_logprobs

    def retain(self, req_ids: set[str]) -> None:
        """Drop the state of every request not in `req_ids`."""
        for req_id in [r for r in self.batch.rows if r not in req_ids]:
            self.batch.remove(req_id)

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in so.finished_req_ids:
            batch.remove(req_id)
        for req_id in so.preempted_req_ids:
            batch.remove(req_id)
        for new in so.scheduled_new_reqs:
            row = batch.add(new)
            if self.state_shapes:
                self._start_state(row, new)
            if self.drafter is not None:
                self.drafter.add_request(row, new.num_computed_tokens)
        rows = batch.rows
        for req_id, block_ids in so.scheduled_cached_reqs.new_block_ids.items():
            batch.append_blocks(rows[req_id], block_ids)

    def _start_state(self, row: int, new: NewRequestData) -> None:
        """Zero row `row` of every layer's state for request `new`, which starts from
        its first token: no KV block holds a state, so the engine core runs such models
        without prefix caching and recomputes preempted requests whole."""
        if new.num_computed_tokens:
            raise RuntimeError(f"request {new.req_id!r} starts at token "
                               f"{new.num_computed_tokens}, but this model's per-request "
                               "state starts at its first token (prefix caching must be off)")
        for layer in self.state_shapes:
            self.kv_caches[layer][row].zero_()

    def _logprobs_by_request(self, inputs: StepInputs, logprob_rows: torch.Tensor,
                             tensors: LogprobsTensors) -> dict[str, TokenLogprobs]:
        return {inputs.req_ids[int(inputs.sample_req[i])]: logprobs
                for i, logprobs in self._logprobs_rows(inputs, logprob_rows,
                                                       tensors).items()}

    def _logprobs_rows(self, inputs: StepInputs, logprob_rows: torch.Tensor,
                       tensors: LogprobsTensors) -> dict[int, TokenLogprobs]:
        """Sampler row -> its token's logprobs, for the rows that return them."""
        ids, lps = tensors.token_ids.tolist(), tensors.logprobs.tolist()
        ranks = tensors.sampled_ranks.tolist()
        result = {}
        for j, i in enumerate(logprob_rows.tolist()):
            k = self.batch.num_logprobs[int(inputs.sampling_rows[i])]
            result[i] = TokenLogprobs(ids[j][:k + 1], lps[j][:k + 1],
                                      [ranks[j], *range(1, k + 1)])
        return result

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs
                         ) -> dict[str, PromptLogprobsChunk]:
        """Logprobs of the prompt's own next tokens at the prompt positions computed
        this step (from the raw logits), for the requests that asked."""
        batch = self.batch
        result = {}
        offsets = np.cumsum(inputs.counts) - inputs.counts
        for i, row in enumerate(inputs.rows.tolist()):
            k = batch.num_prompt_logprobs.get(row)
            if k is None:
                continue
            start = int(inputs.starts[i])
            end = min(start + int(inputs.counts[i]), int(batch.num_prompt_tokens[row]) - 1)
            if end <= start:
                continue
            ids: list[list[int]] = []
            lps: list[list[float]] = []
            ranks: list[int] = []
            # A slice of positions at a time: [positions, vocab] fp32 logits for a whole
            # prompt chunk could take gigabytes (8192 positions x 152k vocabulary).
            for lo in range(start, end, PROMPT_LOGPROBS_SLICE):
                hi = min(lo + PROMPT_LOGPROBS_SLICE, end)
                flat = torch.arange(hi - lo, device=hidden.device) + int(offsets[i]) + lo - start
                logprobs = log_probs(self.model.compute_logits(hidden[flat]).float())
                targets = to_device(batch.token_ids[row, lo + 1:hi + 1].astype(np.int64),
                              self.device)
                t = gather_logprobs(logprobs, targets, k)
                ids += t.token_ids.tolist()
                lps += t.logprobs.tolist()
                ranks += t.sampled_ranks.tolist()
            result[inputs.req_ids[i]] = PromptLogprobsChunk(start, [
                TokenLogprobs(ids[j], lps[j], [ranks[j], *range(1, k + 1)])
                for j in range(end - start)])
        return result
