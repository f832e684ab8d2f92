"""The "ipc" weight buffer as an attacker sends it (issue 37, items 2-4): a file name
the engine opens is distrusted. A FIFO must not block it, a hard link or another user's
file must not be read, and a sender that truncates its buffer mid-update fails its own
update: the engine keeps serving everyone with the old weights."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_no_leaks
from helpers import SUPPORT

from pagellm import LLM, SamplingParams
from pagellm.executor.model.loader import iterate_safetensors, safetensors_files
from pagellm.protocol.utility import WeightUpdate
from pagellm.weights.shm import PREFIX, layout, open_update, shm_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = ["Hello", "def fibonacci(n):"]


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def write_buffer(path: Path, pairs: list[tuple[str, torch.Tensor]]) -> WeightUpdate:
    """What a trainer that writes its own buffer does (`layout`, then the bytes)."""
    specs, size = layout(pairs)
    with open(path, "wb") as f:
        for spec, (_, tensor) in zip(specs, pairs, strict=True):
            f.seek(spec.offset)
            f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        f.truncate(size)
    return WeightUpdate(specs, buffer=str(path), buffer_bytes=size)


def buffer_path(tag: str) -> Path:
    return shm_dir() / f"{PREFIX}{tag}-{os.getpid()}-{time.monotonic_ns()}"


@pytest.fixture(scope="module")
def llm(model_dirs):
    with LLM(str(model_dirs["llama"]), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as engine:
        yield engine


@pytest.fixture(scope="module")
def weights(model_dirs) -> list[tuple[str, torch.Tensor]]:
    return list(iterate_safetensors(safetensors_files(model_dirs["llama"])))


def test_a_fifo_named_as_the_buffer_is_refused_without_waiting(llm, weights):
    """Item 2: the engine's open of a FIFO blocked until a writer came (forever), before
    the regular-file check ran, and every other caller's generate blocked behind it."""
    before = greedy(llm)
    specs, size = layout(weights)
    fifo = buffer_path("fifo")
    os.mkfifo(fifo)
    outcome: list[BaseException | int] = []
    call = threading.Thread(target=lambda: _capture(outcome, llm.update_weights,
                                                    WeightUpdate(specs, str(fifo), size)))
    try:
        call.start()
        call.join(10)
        assert not call.is_alive(), "update_weights blocked on a FIFO"
    finally:
        if call.is_alive():  # let the old code's open return, so the engine can stop
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            call.join(10)
        fifo.unlink()
    assert isinstance(outcome[0], RuntimeError), outcome
    assert "not a regular file" in str(outcome[0])
    assert greedy(llm) == before
    assert_no_leaks(llm)


def test_a_hard_link_and_another_users_file_are_refused(llm, weights, tmp_path):
    """Item 4: `os.link("/etc/shadow", "/tmp/pagellm-weights-x")` was opened and mapped.
    A buffer has one link and the engine's own user as owner. (/etc/shadow itself is on
    another file system than /dev/shm here: a file of this test stands in for it.)"""
    before = greedy(llm)
    secret = write_buffer(buffer_path("secret"), weights)
    link = buffer_path("link")
    os.link(secret.buffer, link)
    try:
        with pytest.raises(RuntimeError, match="2 links"):
            llm.update_weights(WeightUpdate(secret.specs, str(link), secret.buffer_bytes))
        if os.geteuid() == 0:  # only root can give a file away
            os.unlink(link)
            os.chown(secret.buffer, 65534, 65534)
            with pytest.raises(RuntimeError, match="owned by uid 65534"):
                llm.update_weights(secret)
    finally:
        link.unlink(missing_ok=True)
        os.unlink(secret.buffer)
    assert greedy(llm) == before
    assert_no_leaks(llm)


def test_a_buffer_file_larger_than_its_tensors_need_is_refused_unread(llm, weights):
    """The buffer is read whole into host memory, so its size is bounded by what an
    update may carry (twice the model's bytes, aligned), not by what the sender chose."""
    name, tensor = weights[0]
    path = buffer_path("large")
    update = write_buffer(path, [(name, tensor)])
    try:
        with open(path, "r+b") as f:
            f.truncate(2**34)  # 16 GiB, sparse on tmpfs: nothing is allocated
        with pytest.raises(RuntimeError, match="larger than its tensors need"):
            llm.update_weights(WeightUpdate(update.specs, str(path), 2**34))
    finally:
        path.unlink()
    assert_no_leaks(llm)


# The old code mapped the file and handed out views of the mapping: truncating it under
# them was a SIGBUS at the next read, here in a child so that the test can see it. Now
# the truncation (from another thread: a lease holder's own truncate would wait for
# itself) waits until the views are let go.
TRUNCATE_UNDER_VIEWS = """
import os, threading, time, torch
from pagellm.weights.shm import open_update, shared_weights
tensor = torch.arange(1 << 20, dtype=torch.float32)
done = []
with shared_weights([("w", tensor)]) as update:
    print(update.buffer, flush=True)  # for the test to remove, should this die
    with open_update(update) as views:
        truncate = threading.Thread(target=lambda: (os.truncate(update.buffer, 0),
                                                    done.append(time.monotonic())))
        truncate.start()
        time.sleep(0.5)  # the sender shrinks the file meanwhile, or tries to
        assert torch.equal(views[0][1], tensor)
        released = time.monotonic()
    truncate.join(60)
    assert done and done[0] >= released, "the truncation did not wait for the lease"
print("intact")
"""


def test_tensors_of_an_opened_update_survive_the_sender_truncating_its_file():
    """Item 3, deterministically: while the engine holds an update's tensors, the
    sender's truncation of the file waits for it (a read lease), and the tensors read
    the sender's bytes."""
    done = subprocess.run([sys.executable, "-c", TRUNCATE_UNDER_VIEWS], capture_output=True,
                          text=True, timeout=120)
    for line in done.stdout.splitlines()[:1]:
        Path(line).unlink(missing_ok=True)
    assert done.returncode == 0 and "intact" in done.stdout, (done.returncode, done.stderr)


@pytest.mark.parametrize("writer_open", [False, True], ids=["leased", "read"])
def test_a_buffer_that_shrinks_after_its_size_check_is_a_refused_update(weights,
                                                                        writer_open):
    """The file shrinks between the size check and the lease (then the engine must not
    map it: the pages past its end are a SIGBUS), or, where no lease can be had (here a
    writer still has the file open), before it is read whole (a short read): either way
    the update fails naming it, and no tensor of it is handed out."""
    from pagellm.weights import shm as weight_transfer

    path = buffer_path("short")
    update = write_buffer(path, weights)
    real_fstat, calls = os.fstat, []

    def fstat_then_truncate(fd: int) -> os.stat_result:  # the sender wins the race
        result = real_fstat(fd)
        if not calls:
            os.truncate(path, update.buffer_bytes // 2)
        calls.append(fd)
        return result

    writer = os.open(path, os.O_WRONLY) if writer_open else None
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(weight_transfer.os, "fstat", fstat_then_truncate)
            with pytest.raises(ValueError, match=r"shrank to .* while it was opened: "
                                                 r"update refused, old weights kept"), \
                    open_update(update):
                pytest.fail("tensors were handed out")
    finally:
        if writer is not None:
            os.close(writer)
        path.unlink()


def test_a_sender_truncating_its_buffer_mid_update_never_kills_the_engine(big_config,
                                                                          monkeypatch):
    """Item 3 end to end: a sender that truncated its 80 MB buffer a few milliseconds
    into the update killed the engine core (SIGBUS in the copy from the mapping). Each
    such update now either lands whole or is refused whole (the weights' sum, read by
    the test extension, is the new one or the old one, never a mix), and the engine
    serves after every one."""
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))  # rl_extension
    with LLM(str(big_config), load_format="dummy", skip_tokenizer_init=True,
             weight_transfer_config={"backend": "ipc"}, kv_cache_memory_bytes=8 * 2**20,
             max_model_len=256, worker_extension_cls="rl_extension.Probe") as llm:
        prompt = [{"prompt_token_ids": [1, 2, 3, 4]}]
        before = llm.collective_rpc("weight_checksum")[0]
        for delay_ms in (1, 3, 6, 12, 25):
            pairs = _random_weights(big_config, seed=delay_ms)
            path = buffer_path(f"race{delay_ms}")
            update = write_buffer(path, pairs)
            truncator = threading.Timer(delay_ms / 1000, os.truncate, args=(path, 4096))
            truncator.start()
            try:
                llm.update_weights(update)
                expected = sum(float(t.double().sum()) for _, t in pairs)
            except RuntimeError as e:  # refused whole: the old weights stay
                assert "weight buffer" in str(e), e
                expected = before
            finally:
                truncator.join()
                path.unlink()
            before = llm.collective_rpc("weight_checksum")[0]
            assert before == pytest.approx(expected, rel=1e-9, abs=1e-6)
            out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
            assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        assert_no_leaks(llm)


def _random_weights(config_dir: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    generator = torch.Generator().manual_seed(seed)
    return [(n, 0.02 * torch.randn(p.shape, generator=generator))
            for n, p in model.state_dict().items() if "rotary" not in n]


def _capture(into: list[BaseException | int], call, *args) -> None:
    try:
        into.append(call(*args))
    except BaseException as e:  # the test asserts on it
        into.append(e)

