"""The LoRA shrink/expand kernels (kernels/triton_lora.py) against a row-by-row torch
reference written here, through Triton's interpreter on the CPU (TRITON_INTERPRET=1,
set in conftest) or on a GPU.

The cases hit the kernels' edges: runs that start and end inside a row tile, rows in no
run (the base model's, and graph padding: they must keep the base output bit for bit),
unused run rows (0, 0, 0), a slot of width 0 and slots of different widths (the
columns past a slot's width hold NaN: reading them poisons the output), slots no run
names (NaN too), in and out sizes that are multiples of no tile, and K split over
several programs whose partials expand sums."""

from __future__ import annotations

import pytest
import torch
from conftest import runs_triton_kernels

from pagellm.kernels import triton_lora as tl_lora

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IN, OUT, SLOTS, MAX_WIDTH = 72, 88, 4, 24  # tiles are ragged everywhere


def reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              widths: list[int], runs: list[tuple[int, int, int]]) -> torch.Tensor:
    """y + each run's update, one row at a time, in fp32 on the CPU."""
    x, out = x.float().cpu(), y.float().cpu().clone()
    a, b = a.float().cpu(), b.float().cpu()
    for slot, start, end in runs:
        w = widths[slot]
        for t in range(start, end):
            out[t] += b[slot, :, :w] @ (a[slot, :w] @ x[t])
    return out


def make(tokens: int, widths: list[int], used: set[int], dtype: torch.dtype, seed: int = 0
         ) -> tuple[torch.Tensor, ...]:
    """x, y, a, b, device widths: slot s holds widths[s] real rows of a / columns of b;
    the rest of every slot, and every slot not in `used`, is NaN."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, IN, generator=gen)
    y = torch.randn(tokens, OUT, generator=gen)
    a = torch.full((SLOTS, MAX_WIDTH, IN), float("nan"))
    b = torch.full((SLOTS, OUT, MAX_WIDTH), float("nan"))
    for s in used:
        w = widths[s]
        a[s, :w] = torch.randn(w, IN, generator=gen) / IN ** 0.5
        b[s, :, :w] = torch.randn(OUT, w, generator=gen)
    return (x.to(DEVICE, dtype), y.to(DEVICE, dtype), a.to(DEVICE, dtype), b.to(DEVICE, dtype),
            torch.tensor(widths, dtype=torch.int32, device=DEVICE))


def run(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
        widths: torch.Tensor, runs: list[tuple[int, int, int]],
        tiles: tl_lora.LoRATiles | None = None) -> torch.Tensor:
    padded = runs + [(0, 0, 0)] * (SLOTS - len(runs))
    out = y.clone()
    tl_lora.lora_add(x, out, a, b, widths,
                     torch.tensor(padded, dtype=torch.int32, device=DEVICE), tiles)
    return out


SMALL_TILES = tl_lora.LoRATiles(block_m=16, shrink_n=16, shrink_k=32, split_k=2,
                                expand_n=32, expand_k=16)


@runs_triton_kernels
@pytest.mark.parametrize("tiles", [None, SMALL_TILES], ids=["default", "split_k"])
def test_runs_of_different_widths_match_the_reference_and_leave_other_rows_alone(tiles):
    """Three adapters' runs and base-model rows between them: slot 1 is 24 wide (every
    rank column), slot 3 is 8, slot 0 is unused (NaN), slot 2 has width 0 (a
    projection the adapter leaves alone)."""
    widths = [0, 24, 0, 8]
    x, y, a, b, w = make(37, widths, used={1, 3}, dtype=torch.float32)
    runs = [(3, 0, 5), (1, 9, 30), (2, 30, 34)]  # rows 5-8 and 34-36: base model
    out = run(x, y, a, b, w, runs, tiles)
    expected = reference(x, y, a, b, widths, runs)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    for rows in (slice(5, 9), slice(34, 37), slice(30, 34)):
        assert torch.equal(out[rows], y[rows])  # bit for bit


@runs_triton_kernels
def test_no_runs_and_a_run_of_one_row():
    """A decode-sized step: nothing at all when no row has an adapter (what a CUDA
    graph replays for a base-model step), one row when one has."""
    widths = [16, 0, 0, 0]
    x, y, a, b, w = make(3, widths, used={0}, dtype=torch.float32, seed=1)
    assert torch.equal(run(x, y, a, b, w, []), y)
    out = run(x, y, a, b, w, [(0, 2, 3)])
    torch.testing.assert_close(out.cpu(), reference(x, y, a, b, widths, [(0, 2, 3)]),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:2], y[:2])


@runs_triton_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_inputs_track_the_fp32_reference(dtype):
    """16-bit inputs: within the rounding of the 16-bit output and of s, which is
    rounded to the model's dtype before expand (as torch's 16-bit GEMMs round)."""
    widths = [24, 8, 0, 0]
    x, y, a, b, w = make(20, widths, used={0, 1}, dtype=dtype, seed=2)
    runs = [(1, 0, 7), (0, 7, 18)]
    out = run(x, y, a, b, w, runs).float().cpu()
    expected = reference(x, y, a, b, widths, runs)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol * expected.abs().max().item())
    assert torch.equal(out[18:], y[18:].float().cpu())


def test_bad_inputs_are_named():
    x, y, a, b, w = make(4, [8, 0, 0, 0], used={0}, dtype=torch.float32)
    runs = torch.zeros(SLOTS, 3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="share one of"):
        tl_lora.lora_add(x, y.double(), a, b, w, runs)
    with pytest.raises(ValueError, match="a must be a contiguous"):
        tl_lora.lora_add(x, y, a[:, :, :-1], b, w, runs)
    with pytest.raises(ValueError, match="widths must be int32"):
        tl_lora.lora_add(x, y, a, b, w.long(), runs)
    with pytest.raises(ValueError, match="runs must be"):
        tl_lora.lora_add(x, y, a, b, w, runs.long())
