"""An RL loop with pagellm as the rollout engine, end to end on the CPU.

The policy is the built-in demo model (a tiny llama with random weights); the toy,
verifiable reward is the share of even token ids in a completion. Each iteration:

  1. generate n samples per prompt, with the sampled tokens' logprobs;
  2. put the engine to sleep (level 2: weights and KV cache discarded) while the
     trainer, in its own process, takes one REINFORCE step with plain torch and
     transformers on the same weights;
  3. wake the weights, push the new ones from the trainer over the "nccl" backend (a
     torch.distributed group: gloo on the CPU), wake the KV cache, go again.

It prints the mean reward (it rises) and the largest difference between the engine's
logprobs of the sampled tokens and the trainer's own for the same tokens (the
rollout/training mismatch; fp32: at most 1e-4). The last line is a JSON summary.

With --lora R the trainer trains a rank-R LoRA adapter (PEFT) instead of the weights,
and only the adapter travels: it sends PEFT's in-memory state dict back, and the engine
replaces its "policy" adapter in place (`add_lora(TensorLoRARequest(...))`, through
shared memory, no file, no sleep); rollouts run with that adapter.

    python examples/rl_rollout.py [--iterations 12] [--lora 8]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
from multiprocessing.connection import Connection
from typing import Any

N_SAMPLES = 8
MAX_TOKENS = 8
PROMPTS = [[5, 17, 29], [101, 7], [64, 65, 66, 67], [900, 3, 44]]


def reward(token_ids: list[int]) -> float:
    """The verifiable reward: the share of even token ids."""
    return sum(t % 2 == 0 for t in token_ids) / len(token_ids)


def trainer(model_dir: str, init_info: dict[str, Any] | None, conn: Connection, lr: float,
            lora_rank: int = 0) -> None:
    """The trainer process: rank 0 of the weight-transfer group (or, with a LoRA rank,
    the owner of a PEFT adapter). Per iteration it gets the rollouts, reports its
    logprobs' mismatch with the engine's, takes one policy gradient step, and broadcasts
    the new weights (or sends the adapter's tensors back)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagellm.weights.nccl import trainer_init, trainer_send_weights, update_info_for

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora_rank:
        from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

        model = get_peft_model(model, LoraConfig(
            r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]))
        conn.send((model.peft_config["default"].to_dict(),
                   dict(get_peft_model_state_dict(model))))
    trained = [p for p in model.parameters() if p.requires_grad]
    # An adapter starts at zero (B = 0) and learns slowly under SGD: Adam, as LoRA
    # recipes train it.
    optimizer = torch.optim.Adam(trained, lr=lr) if lora_rank else torch.optim.SGD(trained, lr=lr)
    group = trainer_init(init_info) if init_info is not None else None  # waits for it
    while True:
        batch = conn.recv()
        if batch is None:
            return
        mismatch, losses = 0.0, []
        advantages = torch.tensor([r for *_, r in batch])
        advantages = advantages - advantages.mean()
        for (prompt, tokens, engine_logprobs, _), advantage in zip(batch, advantages,
                                                                    strict=True):
            ids = torch.tensor([prompt + tokens])
            logprobs = model(ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)
            taken = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            mismatch = max(mismatch, float((taken.detach() - torch.tensor(
                engine_logprobs)).abs().max()))
            losses.append(-advantage * taken.sum())
        optimizer.zero_grad()
        torch.stack(losses).mean().backward()
        optimizer.step()
        if group is None:  # LoRA: the adapter's tensors are all that travels
            conn.send((mismatch, {name: t.detach().clone() for name, t in
                                  get_peft_model_state_dict(model).items()}))
            continue
        weights = [(name, p.detach()) for name, p in model.state_dict().items()]
        conn.send((mismatch, update_info_for(weights)))
        conn.recv()  # the engine is inside update_weights: broadcast now
        trainer_send_weights(weights, group)


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: 0.5, SGD on the weights; 0.05, "
                             "Adam on a LoRA adapter)")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train a LoRA adapter of this rank instead of the weights")
    ns = parser.parse_args()
    if ns.lr is None:
        ns.lr = 0.05 if ns.lora else 0.5
    if ns.lora:
        return lora_main(ns)

    from pagellm import LLM
    from pagellm.demo.model import demo_model_dir

    model_dir = str(demo_model_dir())
    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                 "world_size": 2}
    here, there = multiprocessing.get_context("spawn").Pipe()
    trainer_process = multiprocessing.get_context("spawn").Process(
        target=trainer, args=(model_dir, init_info, there, ns.lr), daemon=True)
    trainer_process.start()
    rewards, mismatches = [], []
    with LLM(model_dir, enable_sleep_mode=True, weight_transfer_config={"backend": "nccl"},
             kv_cache_memory_bytes=16 * 2**20) as llm:
        llm.init_weight_transfer_engine({"init_info": init_info})
        for iteration in range(ns.iterations):
            batch = rollouts(llm, iteration)
            rewards.append(statistics.mean(r for *_, r in batch))
            llm.sleep(level=2)  # the trainer has the machine
            here.send(batch)
            mismatch, update_info = here.recv()
            mismatches.append(mismatch)
            llm.wake_up(tags=["weights"])
            llm.start_weight_update()
            here.send("go")
            llm.update_weights({"update_info": update_info})
            llm.finish_weight_update(weight_version=str(iteration + 1))
            llm.wake_up(tags=["kv_cache"])
            report(iteration, rewards[-1], mismatch)
    return finish(here, trainer_process, rewards, mismatches)


def report(iteration: int, mean_reward: float, mismatch: float) -> None:
    print(f"iteration {iteration:2d}: mean reward {mean_reward:.3f}, "
          f"max |engine - trainer| logprob {mismatch:.2e}", flush=True)


def finish(here: Connection, trainer_process: Any, rewards: list[float],
           mismatches: list[float]) -> dict[str, Any]:
    """Stop the trainer; print and return the run's JSON summary."""
    here.send(None)
    trainer_process.join(30)
    summary = {"first_reward": rewards[0], "last_reward": rewards[-1],
               "max_mismatch": max(mismatches)}
    print(json.dumps(summary))
    return summary


def rollouts(llm: Any, iteration: int, lora_request: Any = None
             ) -> list[tuple[list[int], list[int], list[float], float]]:
    """n samples per prompt: (prompt, tokens, the engine's logprobs of them, reward)."""
    from pagellm import SamplingParams

    params = SamplingParams(n=N_SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS,
                            logprobs=0, seed=iteration)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                           use_tqdm=False, lora_request=lora_request)
    return [(out.prompt_token_ids, c.token_ids,
             [position[t].logprob for t, position in zip(c.token_ids, c.logprobs,
                                                         strict=True)],
             reward(c.token_ids)) for out in outputs for c in out.outputs]


def lora_main(ns: argparse.Namespace) -> dict[str, Any]:
    """The loop with a LoRA policy: the adapter, not the weights, goes to the engine."""
    from pagellm import LLM, LoRARequest
    from pagellm.demo.model import demo_model_dir
    from pagellm.protocol.lora import TensorLoRARequest

    model_dir = str(demo_model_dir())
    here, there = multiprocessing.get_context("spawn").Pipe()
    trainer_process = multiprocessing.get_context("spawn").Process(
        target=trainer, args=(model_dir, None, there, ns.lr, ns.lora), daemon=True)
    trainer_process.start()
    rewards, mismatches = [], []
    policy = LoRARequest("policy", 1)
    with LLM(model_dir, enable_lora=True, max_lora_rank=ns.lora,
             kv_cache_memory_bytes=16 * 2**20) as llm:
        peft_config, tensors = here.recv()
        for iteration in range(ns.iterations):
            llm.add_lora(TensorLoRARequest("policy", 1, peft_config=peft_config,
                                           lora_tensors=tensors))
            batch = rollouts(llm, iteration, policy)
            rewards.append(statistics.mean(r for *_, r in batch))
            here.send(batch)
            mismatch, tensors = here.recv()
            mismatches.append(mismatch)
            report(iteration, rewards[-1], mismatch)
    return finish(here, trainer_process, rewards, mismatches)


if __name__ == "__main__":
    main()
