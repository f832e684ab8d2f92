"""Where each checkpoint tensor loads on this rank: a `Destination` per tensor name.

A checkpoint stores q/k/v and gate/up as separate tensors, each whole; the decoder holds
them merged (one GEMM each) and, under tensor parallelism, only its rank's slice
(executor/model/parallel.py: Megatron's layout). `destination` maps one
checkpoint name to the parameter view it fills and the part of the checkpoint tensor
that goes there:

    q_proj / k_proj / v_proj    -> rows of qkv_proj: this rank's heads (KV heads may
                                   be replicated across ranks)
    gate_proj / up_proj         -> rows of gate_up_proj: this rank's MLP columns
    o_proj / down_proj          -> columns (row parallel: the input dimension)
    embed_tokens / lm_head      -> this rank's vocabulary rows (the tail rank's padding
                                   rows load nothing)
    everything else             -> the whole parameter (norms, the row-parallel
                                   layers' biases)

Loading (the loader, `load_weights`, the weight-update paths of worker/weight_receiver.py)
goes through these, so every path checks shapes alike. Apart from the model's modules:
any family with Llama's tensor names reuses it whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec

# Checkpoint tensor -> (our parameter, shard) for the merged projections.
_STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"),
            ("v_proj", "qkv_proj", "v"), ("gate_proj", "gate_up_proj", 0),
            ("up_proj", "gate_up_proj", 1))


@dataclass(frozen=True)
class Destination:
    """Where checkpoint tensor `name` loads: `tensor`, a view of a parameter, takes the
    checkpoint tensor's `length` entries from `start` along `dim` (the whole tensor when
    `dim` is None). `shape` is the checkpoint tensor's full shape. `tensor` is None
    for tensors loaded into nothing (computed, or tied)."""

    tensor: torch.Tensor | None
    shape: tuple[int, ...] = ()
    dim: int | None = None
    start: int = 0
    length: int = 0

    def load(self, checkpoint: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy this rank's part of the full `checkpoint` tensor in (shape checked)."""
        if self.tensor is None:
            return
        if tuple(checkpoint.shape) != self.shape:
            raise ValueError(f"shape {tuple(checkpoint.shape)}, the model's is {self.shape}")
        part = checkpoint if self.dim is None else checkpoint.narrow(self.dim, self.start,
                                                                     self.length)
        with torch.no_grad():
            self.tensor.copy_(part, non_blocking=non_blocking)

    def receiver(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The parameter view itself, when a whole checkpoint tensor of `dtype` on
        `device` can be written straight into it (this rank keeps all of it, same dtype
        and device, contiguous): a broadcast lands there with no copy. Else None."""
        t = self.tensor
        whole = self.dim is None or (self.start == 0 and self.length == self.shape[self.dim])
        if t is None or not whole or t.dtype != dtype or t.device != device \
                or not t.is_contiguous():
            return None
        return t


# A checkpoint tensor that loads into nothing (computed or tied), distinct from None.
SKIP = Destination(None)


def checkpoint_keys(param_names: Iterable[str]) -> set[str]:
    """The checkpoint names parameters named `param_names` load from (merged ones split
    back)."""
    keys = set()
    for name in param_names:
        parts = [name.replace(merged, ckpt) for ckpt, merged, _ in _STACKED
                 if f".{merged}." in name]
        keys.update(parts or [name])
    return keys


def destination(name: str, params: Mapping[str, nn.Parameter], spec: DecoderSpec,
                tp: TensorParallel, tied: bool) -> Destination | None:
    """Where checkpoint tensor `name` loads on rank `tp` of a model with parameters
    `params` (the slice of a merged or sharded parameter); SKIP for tensors we compute or
    share (`tied`: the LM head is the embedding); None for a name the model does not
    have."""
    if "rotary_emb.inv_freq" in name:
        return SKIP  # older checkpoints store the RoPE table; we compute it
    if name == "lm_head.weight" and tied:
        return SKIP  # some tied checkpoints still carry a copy
    target, shard = name, None
    for ckpt, merged, shard_id in _STACKED:
        if f".{ckpt}." in name:
            target, shard = name.replace(ckpt, merged), shard_id
            break
    param = params.get(target)
    if param is None:
        return None
    d = spec.head_dim
    if shard is None:
        if target.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = max(0, min(tp.vocab_size, spec.vocab_size - tp.vocab_start))
            return Destination(param[:rows], (spec.vocab_size, param.shape[1]), 0,
                               tp.vocab_start, rows)
        if target.endswith(("o_proj.weight", "down_proj.weight")):  # row parallel
            full = spec.num_heads * d if "o_proj" in target else spec.intermediate_size
            width = param.shape[1]
            return Destination(param, (param.shape[0], full), 1, tp.rank * width, width)
        return Destination(param, tuple(param.shape))  # replicated
    if isinstance(shard, int):  # gate (0) / up (1): column parallel
        size = tp.intermediate_size
        return Destination(param[shard * size:(shard + 1) * size],
                           (spec.intermediate_size, *param.shape[1:]), 0,
                           tp.rank * size, size)
    q_size, kv_size = tp.num_heads * d, tp.num_kv_heads * d
    offset, size, full, start = {
        "q": (0, q_size, spec.num_heads * d, tp.rank * q_size),
        "k": (q_size, kv_size, spec.num_kv_heads * d, tp.kv_head_start * d),
        "v": (q_size + kv_size, kv_size, spec.num_kv_heads * d, tp.kv_head_start * d),
    }[shard]
    return Destination(param[offset:offset + size], (full, *param.shape[1:]), 0, start,
                       size)
