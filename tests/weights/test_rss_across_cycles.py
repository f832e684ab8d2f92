"""The engine process's RSS across RL cycles (generate -> sleep -> update -> wake) whose
rollouts differ in shape, as a trainer's do: every cycle's prompts have new lengths, so
the engine's steps keep meeting GEMM row counts it has not seen. torch's CPU linear
caches a ~250 KB oneDNN set-up per (rows, in, out) shape in two caches of 1024 entries
each; unbounded, they grew the engine by MiBs per cycle for hundreds of cycles
(executor/worker/memory.py `bound_gemm_caches` bounds them). tests/executor/
test_sleep.py's fifty cycles repeat one batch shape and never saw it. Reference: the
engine process's RSS, measured from outside."""

from __future__ import annotations

import random
import statistics

import pytest
from conftest import MODEL_SPECS, assert_no_leaks
from rl_helpers import leftover_buffers, perturbed, rss

from pagellm import LLM, SamplingParams

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

CYCLES = 100
# A rollout: a few prompts of random lengths (new step sizes for the prefill GEMMs);
# two tokens each, so the cycles stay cheap.
ROLLOUT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def rollout_prompts(rng: random.Random, vocab_size: int) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [rng.randrange(16, vocab_size)
                                  for _ in range(rng.randrange(8, 400))]}
            for _ in range(rng.randrange(5, 9))]


@pytest.mark.slow
def test_engine_rss_stays_flat_over_100_cycles_of_rollouts_of_new_shapes(model_dirs):
    model_dir = model_dirs["llama"]
    weights = [perturbed(model_dir, seed=s) for s in range(2)]
    rng, vocab_size = random.Random(0), MODEL_SPECS["llama"].vocab_size
    sizes = []
    with LLM(str(model_dir), enable_sleep_mode=True, weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20, max_model_len=512) as llm:
        for cycle in range(CYCLES):
            outputs = llm.generate(rollout_prompts(rng, vocab_size), ROLLOUT, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == 2 for o in outputs)
            llm.sleep(level=2 if cycle % 2 else 1)
            llm.wake_up(["weights"])
            assert llm.update_weights(weights[cycle % 2].items()) == len(weights[0])
            assert llm.wake_up() is True
            sizes.append(rss(llm))
        assert_no_leaks(llm)
    assert not leftover_buffers()
    # Medians of five cycles around cycle 20 and cycle 100: one sample's noise (a step's
    # activations not yet trimmed) is a few MiB. Unbounded caches grew ~240 MiB here.
    early, late = statistics.median(sizes[17:22]), statistics.median(sizes[-5:])
    mib = [round(s / 2**20) for s in sizes]
    assert late - early < 24 * 2**20, f"engine RSS by cycle (MiB): {mib}"
