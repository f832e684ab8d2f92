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
