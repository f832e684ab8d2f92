"""Mamba-2's mixer (`Mamba2Mixer`), the stateful layer of the Mamba-2 hybrids (Granite
4.0-H: granitemoehybrid.py), as transformers computes it:

    z, xBC, dt = in_proj(h)                  # [T, inner], [T, conv_dim], [T, heads]
    x, B, C = SiLU(conv(xBC))                # causal per channel over the last K tokens
    dt = softplus(dt + dt_bias);  A = -exp(A_log)
    per head (head_dim channels of x; B, C [d_state] of the head's group):
        S <- exp(dt A) S + dt B x^T          # S [d_state, head_dim]
        y  = S^T C + D x
    out = out_proj(RMSNorm_group(y * SiLU(z)))   # the norm's statistic per group

That is gated linear attention with q = C, k = dt B, v = x and a scalar log decay dt A
per head and token, no delta correction: a step computes a prompt chunk in blocks of
CHUNK tokens (`ssd_chunked`: within a block, a causal attention weighted by the decays
between positions plus the block's starting memory read by each query; the memory
carried from block to block) and one-token requests together recurrently
(`ssd_steps`; stateful.py's `scan_requests` chooses). The layer keeps, per request, the
convolution's last K - 1 inputs and S per head, in one float32 state row.

Under tensor parallelism (`mamba_destination`) each rank holds its run of heads (their
z, x and dt rows of in_proj, x's convolution channels, dt_bias, A_log, D, their part of
the norm and of out_proj's columns) and the groups those heads read (their B and C rows
and channels): its own groups where the ranks split them evenly, else the one group its
heads share, replicated (Granite 4.0-H has one group). A group spread over several ranks
sums its norm's statistic over them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.executor.model.attention import AttentionMetadata
from pagellm.executor.model.layers import Linear, RowParallelLinear
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec, Mamba2Spec
from pagellm.executor.model.stateful import ConvBatch, scan_requests
from pagellm.executor.model.weight_map import Destination

CHUNK = 64  # tokens per block of the chunked form


def ssd_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              memory: torch.Tensor) -> torch.Tensor:
    """One token per request, float32. q (C), k (dt B): [R, H, N]; v (x): [R, H, P]; g
    (dt A): [R, H]; memory [R, H, N, P], advanced in place -> [R, H, P] (S^T q). In
    place, without a temporary of the memory's size: the memories are most of a decode
    step's bytes (Granite-4.0-H-350M's 48 requests: 38 MB a layer)."""
    memory.mul_(g.exp()[..., None, None])
    memory.addcmul_(k[..., None], v[..., None, :])
    return torch.matmul(q[..., None, :], memory)[..., 0, :]


def ssd_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                memory: torch.Tensor) -> torch.Tensor:
    """One request's L tokens in blocks of CHUNK, float32. q, k: [H, L, N]; v: [H, L, P];
    g: [H, L]; memory [H, N, P], advanced in place -> [H, L, P].

    With G the log decay summed from the block's start, position l reads
    sum_{s <= l} exp(G_l - G_s) (q_l . k_s) v_s within the block, plus exp(G_l) q_l^T S
    of the block's starting memory S; S moves on to exp(G_last) S + sum_s
    exp(G_last - G_s) k_s v_s^T."""
    heads, length = q.shape[:2]
    pad = -length % CHUNK
    if pad:  # k = 0 and g = 0 past the end: no write, no decay
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g = F.pad(g, (0, pad))
    blocks = (length + pad) // CHUNK
    q, k, v = (t.reshape(heads, blocks, CHUNK, -1) for t in (q, k, v))
    cum = g.reshape(heads, blocks, CHUNK).cumsum(-1)  # [H, N_blocks, C]
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    in_block = (q @ k.transpose(-1, -2)) * decay @ v  # [H, N_blocks, C, P]
    q_start = q * cum.exp()[..., None]  # reads S decayed to each position
    k_end = k * (cum[..., -1:] - cum).exp()[..., None]  # writes decayed to the block's end
    block_decay = cum[..., -1].exp()[..., None, None]  # [H, N_blocks, 1, 1]
    out = torch.empty_like(in_block)
    s = memory
    for i in range(blocks):
        out[:, i] = in_block[:, i] + q_start[:, i] @ s
        s = s * block_decay[:, i] + k_end[:, i].transpose(-1, -2) @ v[:, i]
    memory.copy_(s)
    return out.view(heads, blocks * CHUNK, -1)[:, :length]


def local_groups(m: Mamba2Spec, tp: TensorParallel) -> tuple[int, int]:
    """(the first group, how many) this rank's heads read: its share where the ranks split
    the groups evenly, else the one group its run of heads lies in (parallel.py checks
    that one of the two holds)."""
    if m.n_groups % tp.size == 0:
        count = m.n_groups // tp.size
        return tp.rank * count, count
    return tp.rank * m.n_groups // tp.size, 1


class Mamba2Mixer(nn.Module):
    """Mamba-2's mixer (module docstring) over this rank's heads, its state one float32
    row per request: the convolution's last K - 1 inputs, then each head's memory."""

    def __init__(self, spec: DecoderSpec, m: Mamba2Spec, tp: TensorParallel) -> None:
        super().__init__()
        self.heads = m.num_heads // tp.size
        self.head_dim, self.d_state, self.kernel = m.head_dim, m.d_state, m.conv_kernel
        self.inner = self.heads * m.head_dim  # this rank's channels of z, x and y
        self.groups = local_groups(m, tp)[1]
        self.conv_dim = self.inner + 2 * self.groups * m.d_state
        self.in_proj = Linear(spec.hidden_size, self.inner + self.conv_dim + self.heads,
                              bias=m.proj_bias)
        # Only its parameters, [conv_dim, 1, K] and [conv_dim]: the checkpoint's names.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, m.conv_kernel,
                                groups=self.conv_dim, bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        self.norm = GatedRMSNorm(m, spec.rms_norm_eps, tp)
        self.out_proj = RowParallelLinear(self.inner, spec.hidden_size, m.proj_bias, tp)

    def state_size(self) -> int:
        """A request's state: (K - 1) x conv_dim convolution inputs, then heads x d_state
        x head_dim of memory."""
        return (self.kernel - 1) * self.conv_dim + self.heads * self.d_state * self.head_dim

    def forward(self, x: torch.Tensor, batch: ConvBatch, meta: AttentionMetadata,
                state: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; `state`: this layer's [rows, state_size()]."""
        tokens, heads, n = x.shape[0], self.heads, self.d_state
        conv_size = (self.kernel - 1) * self.conv_dim
        conv_state = state[:, :conv_size].view(-1, self.kernel - 1, self.conv_dim)
        memory = state[:, conv_size:].view(-1, heads, n, self.head_dim)
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, heads], dim=-1)
        xbc = F.silu(batch.convolve(xbc, self.conv1d.weight, self.conv1d.bias, conv_state))
        xs, b, c = xbc.float().split([self.inner, self.groups * n, self.groups * n], dim=-1)
        per_group = heads // self.groups  # heads reading each group's B and C
        b, c = (t.view(tokens, self.groups, n).repeat_interleave(per_group, dim=1)
                for t in (b, c))
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [T, heads]
        g = -self.A_log.float().exp() * dt
        v = xs.view(tokens, heads, self.head_dim)
        y = scan_requests(ssd_steps, ssd_chunked, (c, b * dt[..., None], v, g), memory,
                          meta)  # [T, heads, P]
        y = (y + v * self.D.float()[:, None]).reshape(tokens, self.inner)
        return self.out_proj(self.norm(y, z).to(x.dtype))


class GatedRMSNorm(nn.Module):
    """RMSNorm(y * SiLU(z)) with a statistic per group of the mixer's channels, in
    float32 (transformers' RMSNormGated, its gate before the norm), over this rank's
    channels."""

    def __init__(self, m: Mamba2Spec, eps: float, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.eps, self.n_groups = tp, eps, m.n_groups
        self.inner = m.inner // tp.size
        self.first_group, self.groups = local_groups(m, tp)
        self.group_width = m.inner // m.n_groups
        self.weight = nn.Parameter(torch.empty(self.inner))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y [T, inner] float32, z [T, inner] -> [T, inner]."""
        h = y * F.silu(z.float())
        tokens = h.shape[0]
        if self.groups * self.group_width == self.inner:  # this rank's groups are whole
            parts = h.view(tokens, self.groups, self.group_width)
            h = (parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + self.eps)).view(
                tokens, self.inner)
        else:  # its one group spreads over ranks: the group's sum of squares over them
            sums = h.new_zeros(tokens, self.n_groups)
            sums[:, self.first_group] = h.pow(2).sum(-1)
            sums = self.tp.all_reduce(sums)[:, self.first_group:self.first_group + 1]
            h = h * torch.rsqrt(sums / self.group_width + self.eps)
        return self.weight * h.to(self.weight.dtype)


def mamba_destination(module: str, param: nn.Parameter, m: Mamba2Spec,
                      tp: TensorParallel) -> Destination:
    """Mamba-2 tensor `module` (in_proj, conv1d, out_proj, dt_bias, A_log, D, norm: a
    weight or bias) on this rank (module docstring): in_proj's rows [z | x | B | C | dt]
    of its heads and groups (five parts), the convolution's [x | B | C] (three),
    dt_bias / A_log / D / the norm's of its heads, out_proj's columns (its bias whole)."""
    if tp.size == 1:
        return Destination(param, tuple(param.shape))
    inner, gn, heads = m.inner, m.n_groups * m.d_state, m.num_heads
    local_inner, local_heads = inner // tp.size, heads // tp.size
    first, count = local_groups(m, tp)
    local_gn = count * m.d_state
    x_at, b_at = tp.rank * local_inner, first * m.d_state
    rest = tuple(param.shape[1:])
    runs: tuple[tuple[int, int, int], ...]  # (the whole run's rows, this rank's start, rows)
    if module == "in_proj":
        runs = ((inner, x_at, local_inner), (inner, x_at, local_inner), (gn, b_at, local_gn),
                (gn, b_at, local_gn), (heads, tp.rank * local_heads, local_heads))
    elif module == "conv1d":
        runs = ((inner, x_at, local_inner), (gn, b_at, local_gn), (gn, b_at, local_gn))
    elif module == "out_proj":  # row parallel: its columns; the bias whole, added once
        return Destination(param, (param.shape[0], inner), 1, x_at, local_inner) \
            if param.dim() == 2 else Destination(param, tuple(param.shape))
    else:  # dt_bias, A_log, D [heads]; the norm's weight [inner]
        full = inner if module == "norm" else heads
        width = param.shape[0]
        return Destination(param, (full, *rest), 0, tp.rank * width, width)
    shape = (sum(full for full, _, _ in runs), *rest)
    parts, at, offset = [], 0, 0
    for full, start, length in runs:
        parts.append(Destination(param[at:at + length], shape, 0, offset + start, length))
        at, offset = at + length, offset + full
    return Destination(param, shape, parts=tuple(parts))
