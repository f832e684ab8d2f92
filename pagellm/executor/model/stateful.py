"""What the models whose layers keep a state per request share (LFM2's short
convolutions, lfm2.py; Qwen3.5's linear attention, qwen3_5.py; Mamba-2, mamba2.py): the
causal depthwise convolution over each request's last tokens (`ConvBatch`), the scan of
a recurrent memory request by request (`scan_requests`), the pre-norm layer around a
mixer that is attention or stateful (`StatefulLayer`), and the model that builds the
step's convolution indices once for all its layers (`StatefulModel`).

A step's requests are convolved at once: each request's state rows and its new tokens
are laid end to end in one buffer,

    ext = [ state_0 (K-1) | tokens of request 0 | state_1 (K-1) | tokens of 1 | ... ]

so a token's window is the K entries of `ext` ending at it, whatever the request's
chunk size (one decode token, a prompt chunk); the request's new state is the K-1
entries ending at its last token. The indices are built once per step on the host.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from pagellm.executor.model.attention import AttentionMetadata
from pagellm.executor.model.decoder import DecoderModel
from pagellm.executor.model.layers import RMSNorm
from pagellm.executor.model.mlp import DecoderMLP
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin: [T, 1, rotary_dim]


@dataclass(frozen=True)
class ConvBatch:
    """One step's gather indices for every short-convolution layer (module docstring),
    on the model's device. R requests, T tokens, K the kernel, P = K - 1."""

    rows: torch.Tensor  # [R] int64: each request's state row
    state_at: torch.Tensor  # [R * P] where each request's state entries go in ext
    token_at: torch.Tensor  # [T] where each token goes in ext
    taps: torch.Tensor  # [K, T] ext index of each token's k-th window entry (oldest first)
    last: torch.Tensor  # [R * P] ext indices of each request's new state
    size: int  # T + R * P: ext's rows

    @classmethod
    def of(cls, meta: AttentionMetadata, kernel: int, device: torch.device) -> ConvBatch:
        assert meta.request_rows is not None, "the runner names each request's state row"
        starts = meta.query_start_loc_cpu  # [R + 1]
        num_reqs, tokens, p = len(starts) - 1, int(starts[-1]), kernel - 1
        request = np.repeat(np.arange(num_reqs), np.diff(starts))  # [T]
        token_at = np.arange(tokens) + (request + 1) * p
        first = starts[:-1] + np.arange(num_reqs) * p  # [R] where each request's state goes
        state_at = (first[:, None] + np.arange(p)).reshape(-1)
        end = starts[1:] + (np.arange(num_reqs) + 1) * p  # [R] one past each request's last
        last = (end[:, None] - p + np.arange(p)).reshape(-1)
        taps = token_at[None, :] - p + np.arange(kernel)[:, None]  # [K, T]
        flat = torch.from_numpy(np.concatenate((meta.request_rows, state_at, token_at,
                                                taps.reshape(-1), last))).to(device)
        rows, state, token, taps_flat, last_t = flat.split(
            [num_reqs, num_reqs * p, tokens, kernel * tokens, num_reqs * p])
        return cls(rows, state, token, taps_flat.view(kernel, tokens), last_t,
                   tokens + num_reqs * p)

    def convolve(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 state: torch.Tensor) -> torch.Tensor:
        """x: [T, C] this step's inputs; weight: [C, 1, K]; bias: [C] or None; state:
        [rows, K - 1, C] (x's dtype, or float32 holding x's values exactly), each
        request's row read and then advanced in place ->
        [T, C], each token's causal convolution over its request's last K inputs
        (accumulated in fp32, as the checkpoint's conv1d does, then rounded)."""
        channels, p = x.shape[1], state.shape[1]
        ext = x.new_empty(self.size, channels)
        ext[self.state_at] = state[self.rows].reshape(-1, channels).to(x.dtype)
        ext[self.token_at] = x
        taps = weight.view(channels, -1).float()  # [C, K]
        out = torch.zeros_like(x, dtype=torch.float32) if bias is None \
            else bias.float().expand_as(x).clone()
        for k in range(taps.shape[1]):
            out += ext[self.taps[k]].float() * taps[:, k]
        state[self.rows] = ext[self.last].view(-1, p, channels).to(state.dtype)
        return out.to(x.dtype)


# A recurrent rule's two forms (qwen3_5.py's delta rule, mamba2.py's state-space scan),
# each over per-token inputs (q, k, v, the log decay g, ...) and the memory it advances in
# place: one token per request, inputs [R, H, ...] and memory [R, H, dk, dv] -> [R, H, dv];
# one request's L tokens, inputs [H, L, ...] and memory [H, dk, dv] -> [H, L, dv].
Steps = Callable[..., torch.Tensor]
Chunked = Callable[..., torch.Tensor]


def scan_requests(steps: Steps, chunked: Chunked, inputs: Sequence[torch.Tensor],
                  memory: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Every request's tokens through a recurrent rule from its memory (rows
    `meta.request_rows` of memory [rows, H, dk, dv]): the one-token requests in the
    recurrent form (`_steps_in_place`), each longer chunk by the chunked form.
    inputs: [T, H, ...] each -> [T, H, dv] float32."""
    starts = meta.query_start_loc_cpu
    counts = starts[1:] - starts[:-1]
    rows = meta.request_rows
    assert rows is not None
    single = (counts == 1).nonzero()[0]
    if len(single) == len(counts) and rows[0] == 0 and (np.diff(rows) == 1).all():
        return steps(*inputs, memory[:len(rows)])  # rows 0..R-1, as most decode steps
    out = inputs[0].new_empty(*inputs[0].shape[:2], memory.shape[-1])
    if len(single):
        _steps_in_place(steps, inputs, memory, rows[single], starts[single], out)
    for r in (counts > 1).nonzero()[0].tolist():
        lo, hi = int(starts[r]), int(starts[r + 1])
        s = memory[int(rows[r])]  # [H, dk, dv], a view: advanced in place
        out[lo:hi] = chunked(*(t[lo:hi].transpose(0, 1) for t in inputs), s).transpose(0, 1)
    return out


def _steps_in_place(steps: Steps, inputs: Sequence[torch.Tensor], memory: torch.Tensor,
                    rows: np.ndarray, tokens: np.ndarray, out: torch.Tensor) -> None:
    """The recurrent form for one-token requests in state rows `rows` [n] whose tokens
    are `tokens` [n], writing their outputs into `out`: run by run of consecutive rows,
    each run's memories advanced where they lie (a view). Gathering the memories and
    scattering them back would copy the largest tensors of the step twice (most of a
    mixed step's time in the profile); the inputs gathered are a few hundred times
    smaller."""
    order = np.argsort(rows, kind="stable")
    ordered = rows[order]
    breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
    for part in np.split(np.arange(len(order)), breaks):
        pick = torch.from_numpy(tokens[order[part]]).to(out.device)
        first = int(ordered[part[0]])
        out[pick] = steps(*(t[pick] for t in inputs), memory[first:first + len(part)])


class StatefulLayer(nn.Module, abc.ABC):
    """Pre-norm, the residual added after each block: the family's mixer (`mix`:
    attention, or a layer that reads and advances its state), then the MLP (the spec's
    experts in its sparse layers, of the family's `moe_cls`). A family builds its mixer
    and says how a step reaches it; the norms, the MLP and the order are these."""

    norm_cls: ClassVar[type[RMSNorm]] = RMSNorm
    moe_cls: ClassVar[type[nn.Module]]

    def __init__(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.mlp = self.make_mlp(spec, layer_idx, tp)
        self.input_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps)

    def make_mlp(self, spec: DecoderSpec, layer_idx: int, tp: TensorParallel) -> nn.Module:
        """The layer's MLP: the family's experts in the spec's sparse layers, else the
        gated MLP."""
        sparse = spec.moe is not None and spec.moe.sparse_layers[layer_idx]
        return self.moe_cls(spec, tp) if sparse else DecoderMLP(spec, tp)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, caches: list[torch.Tensor],
                batch: ConvBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden], the previous layer's output not yet added to `residual` ->
        (this layer's, likewise; the residual stream). `caches`: per layer its KV cache
        or its state; `batch` None where no layer keeps one."""
        h, residual = self.input_layernorm(x, residual)
        h = self.mix(rope, h, meta, caches, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    @abc.abstractmethod
    def mix(self, rope: Rope, h: torch.Tensor, meta: AttentionMetadata,
            caches: list[torch.Tensor], batch: ConvBatch | None) -> torch.Tensor:
        """h: [T, hidden] normalised -> the mixer's output [T, hidden]."""


class StatefulModel(DecoderModel):
    """The decoder model whose layers are `StatefulLayer`s convolving over `kernel`
    taps: the step's `ConvBatch` is built once for all of them (none where every layer
    attends: Granite 4.0's dense models)."""

    def __init__(self, spec: DecoderSpec, tp: TensorParallel,
                 max_model_len: int | None = None) -> None:
        super().__init__(spec, tp, max_model_len)
        self.kernel = spec.conv_kernel

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        x = self.embed(input_ids)
        rope = self.rotary_emb.cos_sin(positions, x.dtype)
        batch = None if self.kernel is None else ConvBatch.of(meta, self.kernel, x.device)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta, kv_caches, batch)
        x, _ = self.norm(x, residual)
        return x
