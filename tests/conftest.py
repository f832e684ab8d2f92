"""Shared fixtures: small random-weight models, transformers references, a KV-block
leak check around every engine a test creates, and the engine cores and servers that
tests in several files share (each started with the limits its tests reach).

Fixtures shared by one folder's files live here too: a conftest.py in a test folder
would take the module name `conftest` from this one (no test folder is a package), and
`from conftest import PROMPTS` in the files after it would fail."""

from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels run through the interpreter, which must be chosen
# before any @triton.jit decorator runs; with one they compile for it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PAGELLM_LOG_LEVEL", "WARNING")

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import background
import psutil
import pytest
from helpers import ROOT, Server, free_port, start_engine, stop

from pagellm.demo.model import ModelSpec, make_model
from pagellm.kernels.triton_attention import interpreter_fault, interpreting

if TYPE_CHECKING:
    from pagellm import LLM

torch.set_num_threads(min(2, torch.get_num_threads()))

# Tests that run the Triton kernels: on the CPU through the interpreter, which some
# version pairs cannot run (Triton 3.6 with numpy >= 2.5: `interpreter_fault`). There
# they skip saying why, instead of failing deep inside the interpreter.
INTERPRETER_FAULT = interpreter_fault() if interpreting() else None
runs_triton_kernels = pytest.mark.skipif(INTERPRETER_FAULT is not None,
                                         reason=f"{INTERPRETER_FAULT}")


def _transformers_reads_swiglu_limit() -> bool:
    from transformers import GptOssConfig

    return hasattr(GptOssConfig(), "swiglu_limit")


def _transformers_routes_deepseek_v2_groups() -> bool:
    """transformers 5.0's DeepSeek-V2 router fails on group_limited_greedy (it reads an
    attribute its MoE block never sets); later releases route it."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2 import modeling_deepseek_v2

    config = DeepseekV2Config(hidden_size=8, num_attention_heads=2, moe_intermediate_size=4,
                              n_routed_experts=4,
                              num_experts_per_tok=2, n_group=2, topk_group=1,
                              n_shared_experts=1, topk_method="group_limited_greedy")
    moe = modeling_deepseek_v2.DeepseekV2Moe(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.zero_()
        try:
            moe(torch.zeros(1, 2, 8))
        except AttributeError:
            return False
    return True


# Tests that compare DeepSeek-V2's grouped routing with transformers' (not 5.0's).
deepseek_v2_reference = pytest.mark.skipif(
    not _transformers_routes_deepseek_v2_groups(),
    reason="this transformers cannot route DeepSeek-V2's group_limited_greedy")

def _transformers_ropes_olmo3_per_layer_type() -> bool:
    """transformers 5.0's OLMo 3 rotates every layer with one RoPE (YaRN on all of them
    where configured); later releases give each layer type its own (YaRN on the full
    layers only), as the models' nested rope_parameters say."""
    import inspect

    from transformers.models.olmo3 import modeling_olmo3

    return "layer_type" in inspect.signature(
        modeling_olmo3.Olmo3RotaryEmbedding.forward).parameters


# Tests that compare OLMo 3 (a RoPE per layer type) with transformers' (not 5.0's).
olmo3_reference = pytest.mark.skipif(
    not _transformers_ropes_olmo3_per_layer_type(),
    reason="this transformers rotates every OLMo 3 layer with one RoPE")

# Tests that compare gpt-oss with transformers: their models clamp the experts' SwiGLU
# at 1.5 (config.json's swiglu_limit) so that the clamp bites; transformers 5.0
# hard-codes 7.0 (and alpha 1.702) and ignores the field, later releases read it.
gpt_oss_reference = pytest.mark.skipif(
    not _transformers_reads_swiglu_limit(),
    reason="this transformers hard-codes gpt-oss's swiglu_limit (7.0): the models' 1.5 "
           "is read from config.json by later releases only")

def _transformers_knows(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


# Tests of Qwen3.5, which transformers 5.0 does not know (its config.json neither).
qwen3_5_reference = pytest.mark.skipif(
    not _transformers_knows("qwen3_5_text"),
    reason="this transformers has no Qwen3.5 (qwen3_5_text): neither a reference nor a "
           "config reader")

# Test models: every family, GQA, tied and untied, a head_dim that differs from
# hidden_size / num_heads, and llama3 RoPE scaling. Tied models get a wider init so
# that greedy paths are varied (see FIELD_NOTES).
MODEL_SPECS: dict[str, ModelSpec] = {
    "llama": ModelSpec(arch="llama", hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, intermediate_size=128, vocab_size=1024,
                       rope_scaling={"rope_type": "llama3", "factor": 4.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 256},
                       init_std=0.1, seed=1),
    "qwen2": ModelSpec(arch="qwen2", hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=1, intermediate_size=96, vocab_size=1024,
                       init_std=0.2, seed=2),
    "qwen3": ModelSpec(arch="qwen3", hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32, intermediate_size=128, vocab_size=1024,
                       init_std=0.2, seed=3),
}

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "日本語のテキストと English mixed together, with ümlauts.",
    "import os\nimport sys\n\nclass Engine:\n    def __init__(self, config):\n"
    "        self.config = config\n        self.blocks = []\n" * 3,
    "a b c d e f g h i j k l m n o p",
    "Once upon a time, in a land far away, there lived a scheduler that never starved "
    "a decode. " * 4,
    "x",
    "return self._cache.get(key, default) if key in self._cache else None",
    "  \n\t whitespace-heavy   prompt \n\n",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    background.waiting_tests_last(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the background checks of the selected tests (tests/support/background.py)."""
    background.start_jobs_of({getattr(item, "originalname", item.name)
                              for item in session.items})


def pytest_unconfigure(config: pytest.Config) -> None:
    background.stop_all()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_model(root / name, spec) for name, spec in MODEL_SPECS.items()}


@pytest.fixture(scope="session")
def hf_reference(model_dirs: dict[str, Path]) -> Callable[[str, list[int], int], list[int]]:
    """Greedy continuation from transformers on the same weights (fp32, one prompt at a
    time so that padding plays no part), memoized across tests."""
    from transformers import AutoModelForCausalLM

    models: dict[str, Any] = {}
    cache: dict[tuple[str, tuple[int, ...], int], list[int]] = {}

    def generate(name: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (name, tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            if name not in models:
                models[name] = AutoModelForCausalLM.from_pretrained(
                    model_dirs[name], dtype=torch.float32).eval()
            model = models[name]
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                                     max_new_tokens=max_new_tokens,
                                     attention_mask=torch.ones(1, len(prompt_ids),
                                                               dtype=torch.long))
            cache[key] = out[0, len(prompt_ids):].tolist()
        return cache[key]

    return generate


def assert_no_leaks(llm: Any) -> None:
    """Every request finished or aborted: every KV block is free again."""
    stats = llm.get_stats()
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0, stats
    assert stats.num_free_blocks == stats.num_total_blocks, stats


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    """No test leaves a process behind (engine cores above all). Children that a
    longer-lived process (a module's server) starts during the test are that process's
    own: they are checked when it stops."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield

    def started_here(p: psutil.Process) -> bool:
        try:
            return not any(parent.pid in before for parent in p.parents())
        except psutil.NoSuchProcess:
            return False

    new = [p for p in me.children(recursive=True) if p.pid not in before and started_here(p)]
    _, alive = psutil.wait_procs(new, timeout=15)
    for p in alive:
        p.kill()
    assert not alive, f"processes left behind: {[(p.pid, p.cmdline()[:4]) for p in alive]}"


@pytest.fixture
def engine_at(model_dirs):
    """Start standalone engine cores; stop them all after the test."""
    started: list[subprocess.Popen] = []

    def start(name: str = "llama", address: str | None = None, *extra: str,
              module: str = "pagellm.enginecore") -> tuple[subprocess.Popen, str]:
        address = address or f"tcp://127.0.0.1:{free_port()}"
        engine = start_engine(model_dirs[name], address, *extra, module=module)
        started.append(engine)
        return engine, address

    yield start
    for engine in started:
        stop(engine)


# An engine core with small limits, so that the limits can be reached in a test
# (tests/enginecore/test_input_receiver.py and test_output_sender.py). OUTPUT_HWM stays
# above what a reading client's 300-token request sends: at 20, an engine core whose
# ZeroMQ I/O thread the 2-core machine did not run for 40 steps (~40 ms) dropped the
# well-behaved frontend (test_identity_comes_from_the_connection, 1 run in ~12).
TIGHT_ENGINE = textwrap.dedent("""
    import sys
    import pagellm.enginecore.output_sender as output_sender
    import pagellm.enginecore.input_receiver as input_receiver
    import pagellm.transport.sockets as transport
    output_sender.CONNECT_GRACE_S = 1.0
    output_sender.OUTPUT_HWM = 200
    input_receiver.MAX_CLIENTS = 8
    transport.MAX_MESSAGE_BYTES = 2**20  # the frontends' socket is bound there
    from pagellm.enginecore.__main__ import main
    sys.exit(main(sys.argv[1:]))
""")


# Room for 64k tokens: a client that stops reading must be sent far more than the
# kernel's socket buffers hold (~3 MB on loopback) before its queue can fill.
TIGHT_KV = str(32 * 2**20)


@pytest.fixture(scope="module")
def tight_engine(model_dirs):
    address = f"tcp://127.0.0.1:{free_port()}"
    engine = subprocess.Popen([sys.executable, "-c", TIGHT_ENGINE, "--model",
                               str(model_dirs["llama"]), "--kv-cache-memory-bytes",
                               TIGHT_KV, "--address", address], cwd=ROOT)
    yield engine, address
    stop(engine)


@pytest.fixture(scope="module")
def attached(tight_engine, model_dirs):
    """A well-behaved frontend on the tight engine, and its greedy tokens for PROMPTS."""
    from pagellm import LLM

    _, address = tight_engine
    llm = LLM(str(model_dirs["llama"]), engine_address=address)
    reference = greedy_ids(llm)
    yield llm, reference
    llm.shutdown()


def greedy_ids(llm: LLM, prompts: list[str] = PROMPTS[:4]) -> list[list[int]]:
    """Greedy tokens (12 at most) of `prompts`: what `attached` compares."""
    from pagellm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]


def still_serves(attached) -> None:
    llm, reference = attached
    assert greedy_ids(llm) == reference


@pytest.fixture
def make_llm() -> Iterator[Callable[..., Any]]:
    """Create LLMs (in-process engine core unless multiprocess=True is passed); on
    teardown assert that none leaked a block, then shut them down."""
    from pagellm import LLM

    created: list[Any] = []

    def factory(model: str | Path, **kwargs: Any) -> Any:
        kwargs.setdefault("kv_cache_memory_bytes", 8 * 2**20)
        kwargs.setdefault("multiprocess", False)
        llm = LLM(str(model), **kwargs)
        created.append(llm)
        return llm

    yield factory
    try:
        for llm in created:
            assert_no_leaks(llm)
    finally:
        for llm in created:
            llm.shutdown()


@pytest.fixture(scope="session")
def rl_server(model_dirs: dict[str, Path]) -> Iterator[Any]:
    """`pagellm serve` started for RL, with short limits so that they can be reached in
    a test (tests/frontend/server/test_server_guards.py, and the dev routes' fuzzer): dev endpoints
    behind the key "k", sleep mode, the "nccl" weight transfer with a 2 s join timeout,
    the test extension (rl_extension.Probe), processed logprobs, a 1 s stall timeout
    and 5000 response entries. Tests leave it awake and unpaused."""
    from helpers import Server

    server = Server(model_dirs["llama"], "--api-key", "k", "--enable-dev-endpoints",
                    "--enable-sleep-mode", "--weight-transfer-config",
                    '{"backend": "nccl", "init_timeout_s": 2}',
                    "--worker-extension-cls", "rl_extension.Probe",
                    "--logprobs-mode", "processed_logprobs", "--engine-stall-timeout", "1",
                    "--max-response-entries", "5000",
                    env={"PYTHONPATH": str(Path(__file__).parent / "support")})
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="session")
def guarded(model_dirs, tmp_path_factory) -> Iterator[Server]:
    """`pagellm serve` behind the API key "sesame", trusting chat templates sent in
    requests, with --max-connections 64; its stderr in a log file. Its tests
    (tests/frontend/server/: test_edge, test_serving, test_template_sandbox,
    test_api_models, test_connections) share their requests (tests/support/
    guarded_server.py) and one server."""
    log = tmp_path_factory.mktemp("server") / "stderr.log"
    s = Server(model_dirs["llama"], "--api-key", "sesame", "--trust-request-chat-template",
               "--max-connections", "64", log=log)
    yield s
    assert s.stop() == 0


AGENT_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
# ChatML, plus Qwen3's switch: enable_thinking=False closes an empty reasoning block.
AGENT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and not "
    "enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")


@pytest.fixture(scope="session")
def agent_model_dir(model_dirs, tmp_path_factory) -> Path:
    """The llama test model with a tokenizer that has Qwen's agent tags as single added
    tokens (not special: they stay in the text, as Qwen's do), within the model's
    vocabulary (trained to 4 tokens less, then the tags added), and a chat template
    with Qwen3's enable_thinking switch."""
    return _llama_with_tags(model_dirs, tmp_path_factory.mktemp("agent-model"), AGENT_TAGS,
                            AGENT_TEMPLATE, special=False)


def _llama_with_tags(model_dirs: dict[str, Path], out: Path, tags: tuple[str, ...],
                     template: str, special: bool) -> Path:
    """A copy of the llama test model in `out` whose tokenizer is trained to
    len(tags) tokens less than the model's vocabulary, then given `tags` as single
    tokens (special ones where `special`), with `template` as its chat template."""
    import shutil

    from transformers import PreTrainedTokenizerFast

    from pagellm.demo.model import SPECIAL_TOKENS, train_tokenizer

    shutil.copytree(model_dirs["llama"], out, dirs_exist_ok=True)
    vocab = MODEL_SPECS["llama"].vocab_size
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab - len(tags)),
        eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0], bos_token=None,
        chat_template=template)
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(tags)})
    else:
        tokenizer.add_tokens(list(tags))
    assert len(tokenizer) == vocab
    tokenizer.save_pretrained(out)
    return out


HARMONY_TAGS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>",
                "<|return|>", "<|constrain|>")
# gpt-oss's turn layout (its real template adds a system and a developer message): the
# generation prompt opens an assistant turn whose header the model writes.
HARMONY_TEMPLATE = (
    "{% for m in messages %}{{ '<|start|>' + m['role'] + '<|message|>' + (m['content'] or "
    "'') + '<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}"
    "{% endif %}")


@pytest.fixture(scope="session")
def harmony_model_dir(model_dirs, tmp_path_factory) -> Path:
    """The llama test model with a tokenizer that has gpt-oss's Harmony tags as special
    tokens, as gpt-oss's does (skip_special_tokens drops them from the text), within the
    model's vocabulary, and a Harmony chat template."""
    return _llama_with_tags(model_dirs, tmp_path_factory.mktemp("harmony-model"),
                            HARMONY_TAGS, HARMONY_TEMPLATE, special=True)


@pytest.fixture(scope="session")
def agent_server(agent_model_dir, tmp_path_factory) -> Iterator[Server]:
    """`pagellm serve` as agents use it: tool calls ("auto" through the hermes parser),
    reasoning split off by the qwen3 parser (structured outputs apply after it, so
    constrained chat requests send enable_thinking=False), compact JSON from
    structured outputs (a random model would otherwise emit whitespace until
    max_tokens). Shared by tests/frontend/server/test_agent_requests.py and
    test_responses.py; its stderr in a log file."""
    log = tmp_path_factory.mktemp("agent-server") / "stderr.log"
    s = Server(agent_model_dir, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--reasoning-parser", "qwen3",
               "--structured-outputs-config.disable_any_whitespace", "true", log=log)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="session")
def dev_server(model_dirs) -> Iterator[Server]:
    """`pagellm serve` with the RL dev routes and sleep mode, no API key
    (tests/frontend/server/test_serving.py and test_dev_routes.py). Tests leave it
    awake."""
    s = Server(model_dirs["llama"], "--enable-dev-endpoints", "--enable-sleep-mode")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="session")
def big_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config-only llama of about 80 MB of fp32 weights (dummy-loaded), long enough
    for the ROLL guide's max_model_len=8000: RSS drops are measurable above noise."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("big")
    LlamaConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=1536, vocab_size=8192,
                max_position_embeddings=8192, tie_word_embeddings=False).save_pretrained(path)
    return path
