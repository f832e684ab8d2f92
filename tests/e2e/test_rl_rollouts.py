"""The RL guides and examples as written: the engine configuration of the ROLL
framework's guide (max_model_len=8000, sleep mode, n=4 samples per prompt),
and examples/rl_rollout.py end to end: generate, sleep, train in another process, push
over the "nccl" backend, wake; the reward rises and the engine's logprobs of the
sampled tokens equal the trainer's (fp32, within 1e-4)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT

from pagellm import LLM, SamplingParams


def test_the_roll_guide_configuration_works_as_written(big_config):
    with LLM(str(big_config), gpu_memory_utilization=0.8, block_size=16, max_model_len=8000,
             load_format="dummy", enable_sleep_mode=True, skip_tokenizer_init=True) as llm:
        params = SamplingParams(n=4, top_p=0.99, top_k=100, temperature=0.99, max_tokens=8)
        outputs = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], params, use_tqdm=False)
        assert len(outputs[0].outputs) == 4
        assert all(len(c.token_ids) == 8 for c in outputs[0].outputs)
        llm.sleep(level=1)
        llm.wake_up()
        outputs = llm.generate([{"prompt_token_ids": [5, 6]}], params, use_tqdm=False)
        assert len(outputs[0].outputs) == 4


@pytest.mark.slow
def test_the_rl_rollout_example_raises_the_reward_with_matching_logprobs():
    """examples/rl_rollout.py end to end: generate, sleep, train (another process),
    push over the nccl backend, wake; the reward rises and the engine's logprobs of the
    sampled tokens equal the trainer's within 1e-4 (fp32)."""
    result = subprocess.run([sys.executable, str(ROOT / "examples/rl_rollout.py"),
                             "--iterations", "6"], capture_output=True, text=True,
                            timeout=600, check=True)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["last_reward"] > summary["first_reward"] + 0.2, summary
    assert summary["max_mismatch"] <= 1e-4, summary
