"""What TRL's `vllm_mode="server"` needs from `pagellm serve` (frontend/server/
server_info.py, dev_routes.py's /server_info, serve.py's VLLM_SERVER_DEV_MODE): TRL
starts vLLM as `VLLM_SERVER_DEV_MODE=1 vllm serve M --weight-transfer-config
'{"backend": "nccl"}' --logprobs-mode processed_logprobs --max-logprobs -1` and its
VLLMClient reads `/server_info?config_format=json` before anything else; a 404 there
stopped every trainer at start.

References: the model's own config.json and the flags the server was started with (what
/server_info must report), vLLM's `bool(int(value))` reading of the variable, and
transformers on the same weights (the tokens and logprobs TRL's real client parses out
of the server's answers, run in a child process that installs the `vllm` alias)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import NAME, ROOT, Server, free_port

import pagellm
from pagellm.frontend.server.options import ServerOptions, dev_mode_from_env
from pagellm.frontend.server.serve import with_env_dev_mode
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import EngineInfo

KV_BYTES = 8 * 2**20  # helpers.Server's --kv-cache-memory-bytes
BLOCK_SIZE = 32  # not the default 16: /server_info must report what was asked
MAX_NUM_SEQS = 8
# TRL's documented launch line, as flags (VLLM_SERVER_DEV_MODE=1 in the environment).
TRL_FLAGS = ("--weight-transfer-config", '{"backend": "nccl"}', "--logprobs-mode",
             "processed_logprobs", "--max-logprobs", "-1")


@pytest.fixture(scope="module")
def trl_launched(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
                 request: pytest.FixtureRequest
                 ) -> Iterator[tuple[Server, Path, TRLClientRun | None]]:
    """`pagellm serve` as TRL starts vLLM: dev mode from the environment alone (no
    --enable-dev-endpoints), no API key (TRL's client sends none). TRL's client (`trl`),
    when its tests run, starts first: it imports TRL while the server starts, and calls
    the server as soon as it is up, while the tests before its own go on."""
    directory = tmp_path_factory.mktemp("trl-server")
    log = directory / "stderr.log"
    client = TRLClientRun(directory) if trl_tests_selected(request) else None
    server = None
    try:
        server = Server(model_dirs["llama"], *TRL_FLAGS, "--block-size", str(BLOCK_SIZE),
                        "--max-num-seqs", str(MAX_NUM_SEQS), log=log,
                        env={"VLLM_SERVER_DEV_MODE": "1"})
        if client is not None:
            client.send(server.url)
        yield server, log, client
    finally:
        if client is not None:
            client.stop()
        if server is not None:
            assert server.stop() == 0


@pytest.fixture(scope="module")
def trl_served(trl_launched: tuple[Server, Path, TRLClientRun | None]) -> tuple[Server, Path]:
    return trl_launched[:2]


@pytest.fixture(scope="module")
def trl_server(trl_launched: tuple[Server, Path, TRLClientRun | None]) -> Server:
    return trl_launched[0]


def server_info(server: Server, query: str = "?config_format=json",
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
    status, data = server.request("GET", "/server_info" + query, headers=headers)
    return status, json.loads(data)


# --- VLLM_SERVER_DEV_MODE ------------------------------------------------------------

@pytest.mark.parametrize("value", ["1", "0", "2", " 1 ", "00", "+1", "-1", "007"])
def test_dev_mode_reads_an_integer_as_vllm_does(value):
    assert dev_mode_from_env({"VLLM_SERVER_DEV_MODE": value}) is bool(int(value))


def test_dev_mode_is_off_when_the_variable_is_unset():
    assert dev_mode_from_env({}) is False


@pytest.mark.parametrize("value", ["true", "", "yes", "1.0"])
def test_dev_mode_refuses_a_value_that_is_no_integer_naming_the_variable(value):
    with pytest.raises(ValueError, match="VLLM_SERVER_DEV_MODE must be an integer"):
        dev_mode_from_env({"VLLM_SERVER_DEV_MODE": value})


@pytest.mark.parametrize(("value", "flag", "expected"), [
    ("1", False, True), ("0", False, False), (None, False, False), ("0", True, True),
    (None, True, True)])
def test_the_variable_turns_the_dev_endpoints_on_and_never_off(monkeypatch, value, flag,
                                                               expected):
    if value is None:
        monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    else:
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", value)
    options = ServerOptions(served_model_name="m", enable_dev_endpoints=flag)
    assert with_env_dev_mode(options).enable_dev_endpoints is expected


def test_a_dev_mode_value_that_is_no_integer_stops_the_server_before_the_engine(model_dirs):
    """vLLM crashes on `int("true")` deep in a traceback; here it is one line naming
    the variable, and exit status 2 like every other bad option."""
    done = subprocess.run(
        [sys.executable, "-m", "pagellm", "serve", str(model_dirs["llama"]), "--port",
         str(free_port())], cwd=ROOT, capture_output=True, timeout=120,
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "true"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert b"VLLM_SERVER_DEV_MODE must be an integer" in done.stderr
    assert b"'true'" in done.stderr


def test_the_variable_alone_serves_the_dev_routes_and_says_so(trl_served):
    server, log = trl_served
    assert server.get("/is_paused") == (200, b'{"is_paused":false}')
    assert server_info(server)[0] == 200
    text = log.read_text()
    assert "VLLM_SERVER_DEV_MODE=1 turned on --enable-dev-endpoints" in text
    assert "no --api-key guards them" in text


def test_server_info_does_not_exist_without_dev_mode(guarded):
    """guarded: `pagellm serve` without --enable-dev-endpoints or the variable."""
    status, body = guarded.request("GET", "/server_info?config_format=json",
                                   headers={"Authorization": "Bearer sesame"})
    assert status == 404, body


def test_server_info_is_behind_the_api_key(rl_server):
    """rl_server: dev endpoints behind the key "k", "nccl" with a 2 s join timeout, the
    test worker extension."""
    assert server_info(rl_server)[0] == 401
    status, body = server_info(rl_server, headers={"Authorization": "Bearer k"})
    assert status == 200
    config = body["vllm_config"]
    assert config["weight_transfer_config"] == {"backend": "nccl", "init_timeout_s": 2}
    assert config["parallel_config"]["worker_extension_cls"] == "rl_extension.Probe"


# --- /server_info against the served model ---------------------------------------------

def test_server_info_json_reports_the_model_and_flags_under_vllm_names(trl_server,
                                                                      model_dirs):
    status, body = server_info(trl_server)
    assert status == 200 and set(body) == {"vllm_config"}
    config = body["vllm_config"]
    hf = json.loads((model_dirs["llama"] / "config.json").read_text())
    model = config["model_config"]
    assert model["model"] == str(model_dirs["llama"])
    assert model["served_model_name"] == NAME
    assert model["max_model_len"] == hf["max_position_embeddings"]
    assert model["dtype"] == f"torch.{hf.get('torch_dtype') or hf['dtype']}"
    assert model["logprobs_mode"] == "processed_logprobs"
    assert model["max_logprobs"] == -1
    cache = config["cache_config"]
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    block_bytes = (2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim
                   * BLOCK_SIZE * 4)  # K and V, fp32
    assert cache["block_size"] == BLOCK_SIZE
    assert cache["num_gpu_blocks"] == KV_BYTES // block_bytes
    assert cache["enable_prefix_caching"] is True
    assert config["scheduler_config"]["max_num_seqs"] == MAX_NUM_SEQS
    parallel = config["parallel_config"]
    assert (parallel["tensor_parallel_size"], parallel["data_parallel_size"]) == (1, 1)
    assert config["weight_transfer_config"] == {"backend": "nccl"}
    assert config["lora_config"] is None  # TRL's probe for adapter syncs


def test_server_info_text_is_vllms_one_line_summary_and_the_default(trl_server, model_dirs):
    status, body = server_info(trl_server, "")
    assert status == 200
    text = body["vllm_config"]
    assert isinstance(text, str) and "\n" not in text
    assert text.startswith(f"model={str(model_dirs['llama'])!r}, ")
    for part in ("max_seq_len=2048", f"served_model_name={NAME}", "dtype=torch.float32",
                 "tensor_parallel_size=1", "enable_prefix_caching=True"):
        assert part in text.split(", "), (part, text)
    assert server_info(trl_server, "?config_format=text") == (status, body)


def test_server_info_refuses_an_unknown_format_naming_the_parameter(trl_server):
    status, body = server_info(trl_server, "?config_format=yaml")
    assert status == 400
    assert body["error"]["message"] == "config_format must be text or json, got 'yaml'"


# --- /server_info's tree, from an engine's figures (no server) -----------------------

def server_info_app(args: EngineArgs, info: EngineInfo, served_model_name: str | None
                    ) -> Any:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagellm.frontend.server.dev_routes import add_dev_routes

    app = FastAPI()
    engine = SimpleNamespace(info=info, engine_args=args)
    add_dev_routes(app, engine, None, served_model_name)  # type: ignore[arg-type]
    return TestClient(app)


def test_server_info_counts_what_the_engine_core_reports_not_the_frontend_flags():
    """With --engine-address the frontend's flags need not match the core's: the
    EngineInfo the core sent (4 workers, 2 cores, bfloat16 on cuda:0) is what runs."""
    args = EngineArgs(model="/models/m")
    info = EngineInfo("/models/m", 64, 100, 16, 8, 64, "cuda:0", "bfloat16",
                      world_size=4, data_parallel_size=2)
    with server_info_app(args, info, None) as client:
        config = client.get("/server_info?config_format=json").json()["vllm_config"]
    assert config["parallel_config"]["tensor_parallel_size"] == 4
    assert config["parallel_config"]["data_parallel_size"] == 2
    assert config["model_config"]["dtype"] == "torch.bfloat16"
    assert config["model_config"]["served_model_name"] == "/models/m"
    assert config["device_config"] == {"device": "cuda", "device_type": "cuda"}
    assert config["weight_transfer_config"] is None  # TRL refuses to sync on this


def test_server_info_shows_no_address_or_path_but_the_models():
    args = EngineArgs(model="/models/m", data_parallel_address="10.9.8.7",
                      master_addr="10.6.5.4", generation_config="/secret/generation")
    info = EngineInfo("/models/m", 64, 100, 16, 8, 64, "cpu", "float32")
    with server_info_app(args, info, "served") as client:
        for query in ("?config_format=json", "?config_format=text"):
            text = client.get("/server_info" + query).text
            assert "/models/m" in text
            for secret in ("10.9.8.7", "10.6.5.4", "/secret/generation"):
                assert secret not in text, (query, secret)


# --- TRL's own client -------------------------------------------------------------------

TRL_USABLE = importlib.util.find_spec("trl") is not None and hasattr(pagellm, "install_as_vllm")
needs_trl = pytest.mark.skipif(
    not TRL_USABLE,
    reason="needs trl (pip install --no-deps trl==1.16.0) and pagellm.install_as_vllm")

# Runs in a child process: install_as_vllm() maps `vllm` onto pagellm for the whole
# process (a meta-path finder, sys.modules entries), which must not leak into the tests.
# It imports TRL first, then reads the server's URL on stdin (`TRLClientRun.send`).
TRL_CLIENT = textwrap.dedent("""
    import json, sys
    import pagellm
    pagellm.install_as_vllm()
    from trl.generation.vllm_client import VLLMClient

    prompts, token_prompt, chat, tool, regex = json.loads(sys.argv[1])
    base_url = sys.stdin.readline().strip()
    if not base_url:
        sys.exit("no server URL on stdin")
    client = VLLMClient(base_url=base_url, connection_timeout=30)
    out = {"model": client.model, "world_size": client.get_world_size(),
           "server_info": client.get_server_info()}
    out["greedy"] = client.generate(prompts, temperature=0.0, max_tokens=8, logprobs=3)
    out["sampled"] = client.generate([token_prompt], n=2, max_tokens=6, logprobs=2,
                                     generation_kwargs={"seed": 7})
    out["no_logprobs"] = client.generate([token_prompt], max_tokens=2, logprobs=None)
    out["chat"] = client.chat([chat], temperature=0.0, max_tokens=6, logprobs=0)
    out["tools"] = client.chat([chat], temperature=0.0, max_tokens=2, tools=[tool])
    out["regex"] = client.generate(prompts[:1], temperature=0.0, max_tokens=8,
                                   structured_outputs_regex=regex)
    client.reset_prefix_cache()
    sequence = out["greedy"]["prompt_ids"][0] + out["greedy"]["completion_ids"][0]
    out["sequence"] = [sequence, len(out["greedy"]["prompt_ids"][0])]
    out["sequence_logprobs"] = client.get_sequence_logprobs(
        [sequence], [out["sequence"][1]], top_logprobs=4)
    try:
        client.init_communicator(device="cpu")
    except NotImplementedError as e:  # TRL's own refusal, past the server checks
        out["init_communicator"] = str(e)
    print("RESULT " + json.dumps(out))
""")
TRL_PROMPTS = ["Hello", "The quick brown fox jumps"]
TOKEN_PROMPT = [5, 17, 300, 42]
CHAT = [{"role": "user", "content": "Name a prime number."}]
TOOL = {"type": "function", "function": {
    "name": "is_prime", "description": "Whether n is prime.",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}},
                   "required": ["n"]}}}
REGEX = "[0-9]{4}"


CLIENT_TIMEOUT_S = 300  # from the server's URL on: then it is killed


def trl_tests_selected(request: pytest.FixtureRequest) -> bool:
    """Whether TRL's client is to run: trl installed, and a test of this module that
    uses `trl` selected."""
    return TRL_USABLE and any(
        getattr(item, "module", None) is request.module
        and "trl" in getattr(item, "fixturenames", ()) for item in request.session.items)


class TRLClientRun:
    """TRL_CLIENT in a child process, its output in `directory`: started (`__init__`),
    given the server's URL (`send`), then what it returned (`result`, which waits for
    it CLIENT_TIMEOUT_S after `send` at most and kills it past that, as subprocess.run's
    timeout did). `stop` kills it if it still runs."""

    def __init__(self, directory: Path) -> None:
        self.stdout, self.stderr = directory / "client-stdout", directory / "client-stderr"
        self.deadline = float("inf")
        with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", TRL_CLIENT,
                 json.dumps([TRL_PROMPTS, TOKEN_PROMPT, CHAT, TOOL, REGEX])],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=out, stderr=err,
                env={**os.environ, "PYTHONPATH": str(ROOT)})

    def send(self, base_url: str) -> None:
        assert self.proc.stdin is not None
        self.deadline = time.monotonic() + CLIENT_TIMEOUT_S
        with contextlib.suppress(BrokenPipeError):  # it failed: result() shows why
            self.proc.stdin.write(f"{base_url}\n".encode())
            self.proc.stdin.close()

    def result(self) -> dict[str, Any]:
        try:
            returncode = self.proc.wait(max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        stdout = self.stdout.read_text()
        stderr = self.stderr.read_text()
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert returncode == 0 and lines, stderr[-3000:]
        return json.loads(lines[-1].removeprefix("RESULT "))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()


@pytest.fixture(scope="module")
def trl(trl_launched: tuple[Server, Path, TRLClientRun | None],
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """What TRL's VLLMClient returned for each call, from a child process (started with
    the server, `trl_launched`; here, if that did not foresee this test)."""
    server, _, client = trl_launched
    if client is not None:
        yield client.result()
        return
    client = TRLClientRun(tmp_path_factory.mktemp("trl-client"))
    try:
        client.send(server.url)
        yield client.result()
    finally:
        client.stop()


@pytest.fixture(scope="module")
def hf_log_softmax(model_dirs: dict[str, Path]) -> Any:
    """Per position, transformers' log-probabilities of the next token (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"],
                                                 dtype=torch.float32).eval()

    def compute(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)  # [len(ids), vocab]

    return compute


@pytest.fixture(scope="module")
def tokenizer(model_dirs: dict[str, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs["llama"])


@needs_trl
def test_trl_client_reads_the_server_as_it_reads_vllm(trl):
    assert trl["model"] == NAME
    assert trl["world_size"] == 1
    assert trl["server_info"]["weight_transfer_config"] == {"backend": "nccl"}
    assert trl["server_info"]["model_config"]["logprobs_mode"] == "processed_logprobs"


@needs_trl
def test_trl_generate_is_transformers_greedy_with_its_logprobs(trl, tokenizer, hf_reference,
                                                               hf_log_softmax):
    greedy = trl["greedy"]
    assert greedy["prompt_ids"] == [tokenizer.encode(p) for p in TRL_PROMPTS]
    for prompt, completion, logprobs, ids in zip(
            greedy["prompt_ids"], greedy["completion_ids"], greedy["logprobs"],
            greedy["logprob_token_ids"], strict=True):
        assert completion == hf_reference("llama", prompt, 8)
        reference = hf_log_softmax(prompt + completion)[len(prompt) - 1:-1]
        for position, (values, top) in enumerate(zip(logprobs, ids, strict=True)):
            expected = reference[position].topk(3)
            assert top == expected.indices.tolist()  # greedy: the sampled one is top-1
            assert values == pytest.approx(expected.values.tolist(), abs=1e-3)


@needs_trl
def test_trl_sampled_completions_carry_the_models_logprobs(trl, hf_log_softmax):
    """n=2 at temperature 1: whatever was sampled, each position lists the sampled token
    and the top 2 (TRL's N+1), sorted, with transformers' log-probabilities."""
    sampled = trl["sampled"]
    assert sampled["prompt_ids"] == [TOKEN_PROMPT]
    assert len(sampled["completion_ids"]) == 2
    for completion, logprobs, ids in zip(sampled["completion_ids"], sampled["logprobs"],
                                         sampled["logprob_token_ids"], strict=True):
        reference = hf_log_softmax(TOKEN_PROMPT + completion)[len(TOKEN_PROMPT) - 1:-1]
        for position, token in enumerate(completion):
            top2 = reference[position].topk(2).indices.tolist()
            assert ids[position] == sorted({token, *top2},
                                           key=lambda t: -reference[position][t].item())
            assert logprobs[position] == pytest.approx(
                [reference[position][t].item() for t in ids[position]], abs=1e-3)
    assert trl["no_logprobs"]["logprobs"] is None


@needs_trl
def test_trl_chat_renders_the_template_and_decodes_greedily(trl, tokenizer, hf_reference):
    chat = trl["chat"]
    prompt = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
    assert chat["prompt_ids"] == [prompt]
    assert chat["completion_ids"] == [hf_reference("llama", prompt, 6)]
    assert [ids[0] for ids in chat["logprob_token_ids"][0]] == chat["completion_ids"][0]


@needs_trl
def test_trl_chat_with_tools_renders_them_without_needing_a_tool_parser(trl, tokenizer):
    """TRL sends tool_choice "none" with its tools: the server renders them into the
    prompt and needs no --enable-auto-tool-choice."""
    prompt = list(tokenizer.apply_chat_template(CHAT, tools=[TOOL], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
    assert trl["tools"]["prompt_ids"] == [prompt]
    assert len(trl["tools"]["completion_ids"][0]) <= 2


@needs_trl
def test_trl_structured_outputs_regex_constrains_the_completion(trl, tokenizer):
    import re

    completion = trl["regex"]["completion_ids"][0]
    assert re.fullmatch(REGEX, tokenizer.decode(completion, skip_special_tokens=True))


@needs_trl
def test_trl_sequence_logprobs_score_the_completion_as_transformers(trl, hf_log_softmax):
    sequence, prompt_length = trl["sequence"]
    scored = trl["sequence_logprobs"]
    reference = hf_log_softmax(sequence)
    positions = range(prompt_length, len(sequence))
    assert scored["actual_token_ids"] == [[[sequence[p]] for p in positions]]
    assert [a[0] for a in scored["actual_logprobs"][0]] == pytest.approx(
        [reference[p - 1][sequence[p]].item() for p in positions], abs=1e-3)
    for i, p in enumerate(positions):
        top = reference[p - 1].topk(4)
        assert scored["logprob_token_ids"][0][i] == top.indices.tolist()
        assert scored["logprobs"][0][i] == pytest.approx(top.values.tolist(), abs=1e-3)


@needs_trl
def test_trl_init_communicator_passes_the_server_checks_then_needs_cuda(trl):
    """TRL asks /server_info for weight_transfer_config (a RuntimeError when None) and
    /get_world_size before it looks at the device: its own NotImplementedError for a
    CPU trainer shows both answered as vLLM's do. (The NCCL broadcast itself needs
    CUDA on TRL's side.)"""
    assert "needs a CUDA device, got 'cpu'" in trl["init_communicator"]
