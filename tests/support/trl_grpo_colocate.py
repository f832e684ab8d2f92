"""TRL's GRPOTrainer in colocate mode, unchanged, on pagellm through install_as_vllm():
run by tests/e2e/test_rl_frameworks.py as `python trl_grpo_colocate.py MODEL_DIR OUT_DIR`
(its own interpreter: the `vllm` alias stays out of the test process).

Two training steps with a reward that prefers long completions, a learning rate large
enough to move the weights; then one more weight sync, and the engine's greedy tokens
are written next to transformers' greedy tokens on the trained model, for the test to
compare (they are equal only if every sync landed in the engine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pagellm

pagellm.install_as_vllm()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from pagellm import SamplingParams  # noqa: E402

PROMPTS = ["Hello", "The quick brown fox", "def fibonacci(n):", "a b c d e f"]


def reward_length(completions: list[str], **kwargs: object) -> list[float]:
    return [float(len(c)) for c in completions]


def main(model_dir: str, out_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to="none", max_steps=2,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        learning_rate=5e-2, logging_steps=1, save_strategy="no", seed=0,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64,
        vllm_gpu_memory_utilization=0.3, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_length, args=config,
                          processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}))
    trainer.train()
    generation = trainer.vllm_generation
    generation.sync_weights()  # the trained weights, as the next step would push them
    llm = generation.llm
    trained = trainer.model
    moved = max(float((p.detach() - initial[n]).abs().max())
                for n, p in trained.named_parameters())
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine_tokens = [list(o.outputs[0].token_ids)
                     for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    trained.eval()
    hf_tokens = []
    with torch.no_grad():  # greedy by hand: no generation_config the trainer may have set
        for output in llm.generate(PROMPTS, params, use_tqdm=False):
            ids = list(output.prompt_token_ids)
            for _ in range(8):
                ids.append(int(trained(torch.tensor([ids])).logits[0, -1].argmax()))
            hf_tokens.append(ids[len(output.prompt_token_ids):])
    remote = type(llm.llm_engine.model_executor.driver_worker.model_runner.model).__name__
    Path(out_dir, "result.json").write_text(json.dumps({
        "global_step": trainer.state.global_step, "moved": moved,
        "engine_tokens": engine_tokens, "hf_tokens": hf_tokens, "model_class": remote,
        "log": trainer.state.log_history}))
    llm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
