"""A causal depthwise convolution over each request's last tokens, for the layers that
keep their recent inputs as a state per request (LFM2's short convolutions, lfm2.py;
the convolution before Qwen3.5's linear attention, qwen3_5.py).

A step's requests are convolved at once: each request's state rows and its new tokens
are laid end to end in one buffer,

    ext = [ state_0 (K-1) | tokens of request 0 | state_1 (K-1) | tokens of 1 | ... ]

so a token's window is the K entries of `ext` ending at it, whatever the request's
chunk size (one decode token, a prompt chunk); the request's new state is the K-1
entries ending at its last token. The indices are built once per step on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.executor.model.attention import AttentionMetadata


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
