"""protocol/engine_args.py: the RL options (sleep mode, the weight-transfer config, a
worker extension) as vLLM's command line spells them, and what EngineArgs refuses in
them. References: vLLM's flag names and a round trip through the command line. (The
other engine options are tests/protocol/test_protocol.py's.)"""

from __future__ import annotations

import json

import pytest


def test_cli_takes_the_rl_options_as_vllm_spells_them():
    import argparse

    from pagellm.protocol.engine_args import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args([
        "--model", "m", "--enable-sleep-mode", "--weight-transfer-config",
        json.dumps({"backend": "ipc"}), "--worker-extension-cls", "pkg.mod.Ext"]))
    assert args.enable_sleep_mode and args.weight_transfer_config == {"backend": "ipc"}
    assert EngineArgs.from_cli_args(parser.parse_args(args.to_cli_args())) == args
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--weight-transfer-config", "{not json"])
    with pytest.raises(ValueError, match="weight_transfer_config must be"):
        EngineArgs(model="m", weight_transfer_config={"backend": "carrier-pigeon"})
    with pytest.raises(ValueError, match="weight_transfer_config must be"):
        EngineArgs(model="m", weight_transfer_config={"init_timeout_s": 5})
    for bad in (0, -1, float("inf"), 10**6):
        with pytest.raises(ValueError, match="init_timeout_s"):
            EngineArgs(model="m", weight_transfer_config={"backend": "nccl",
                                                          "init_timeout_s": bad})


def test_the_options_trl_passes_are_accepted_and_what_is_not_served_is_named():
    """Issue 39: TRL's vLLM engine passes model_impl, generation_config,
    enable_lora=False and async_scheduling=False; they raised TypeError. Values this
    engine would not honour are refused naming the option, never dropped (and
    async_scheduling=True, issue 45, is served)."""
    import argparse

    from pagellm import AsyncEngineArgs
    from pagellm.protocol.engine_args import EngineArgs

    args = EngineArgs.from_kwargs(model="m", model_impl="vllm", generation_config="vllm",
                                  enable_lora=False, async_scheduling=False)
    assert (args.model_impl, args.generation_config) == ("vllm", "vllm")
    assert AsyncEngineArgs is EngineArgs  # vLLM's name for AsyncLLM.from_engine_args
    assert EngineArgs(model="m", async_scheduling=True).async_scheduling
    for name, bad in (("model_impl", "transformers"),):
        with pytest.raises(ValueError, match=f"{name}=.* is not supported"):
            EngineArgs(model="m", **{name: bad})
    # LoRA (issue 42): served, its sizes bounded where they enter.
    lora = EngineArgs(model="m", enable_lora=True, max_loras=4, max_lora_rank=64)
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank) == (True, 4, 64)
    for field, bad, why in (("max_lora_rank", 12, "max_lora_rank must be one of"),
                            ("max_loras", 0, "max_loras"), ("max_loras", 10**6, "max_loras"),
                            ("max_cpu_loras", 2, "max_cpu_loras")):
        with pytest.raises(ValueError, match=why):
            EngineArgs(model="m", enable_lora=True, **{"max_loras": 4, field: bad})
    for bad in (5, "", "x" * 5000):
        with pytest.raises(ValueError, match="generation_config must be"):
            EngineArgs(model="m", generation_config=bad)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parsed = EngineArgs.from_cli_args(parser.parse_args(
        ["--model", "m", "--generation-config", "/models/gen", "--model-impl", "vllm"]))
    assert parsed.generation_config == "/models/gen" and parsed.model_impl == "vllm"
    assert EngineArgs.from_cli_args(parser.parse_args(parsed.to_cli_args())) == parsed
