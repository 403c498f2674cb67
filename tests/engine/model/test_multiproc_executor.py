"""Tensor parallelism through `MultiprocExecutor`: real worker processes over gloo give HF's and
the one-worker engine's greedy tokens while each holds about half the weights; bad TP sizes are
refused before any process starts; a dead or hung worker ends its rank."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from shoal.client.api.llm import LLM
from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.model.executor import make_executor
from shoal.engine.model.multiproc_executor import MultiprocExecutor
from shoal.engine.model_arch import ModelArch
from shoal.engine.protocol import SamplingParams
from tests.engine.model.tp_child import start_tp2_engine
from tests.factories import hf_reference, make_tiny_checkpoint, make_tiny_gguf
from tests.reference import assert_greedy_matches, hf_greedy

PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 40, 2, 17, 23, 4], [20, 21]]
MAX_TOKENS = 12

CHECKPOINTS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    # A vocabulary two workers cannot split evenly: padded blocks.
    "qwen2-biases-odd-vocab": {"arch": "qwen2", "vocab_size": 515},
    "mixtral": {"arch": "mixtral"},
    # One KV head for two workers: each holds it (replicated).
    "tied-embeddings-one-kv-head": {
        "arch": "llama",
        "tie_word_embeddings": True,
        "num_kv_heads": 1,
    },
}


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Any:
    """A TP executor in this process sets its driver worker's torch threads process-wide."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _checkpoint(tmp_path: Path, name: str) -> str:
    if name == "gguf-q8_0":
        checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
        return make_tiny_gguf(tmp_path / "tiny.gguf", checkpoint, qtype="Q8_0")
    return make_tiny_checkpoint(tmp_path / "ckpt", **CHECKPOINTS[name])


def _core(llm: LLM) -> EngineCore:
    core: EngineCore = cast(Any, llm)._driver.engine_core  # the in-process engine
    return core


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*CHECKPOINTS, "gguf-q8_0"])
def test_two_workers_give_hfs_and_one_workers_tokens_holding_half_the_weights(
    tmp_path: Path, name: str
) -> None:
    path = _checkpoint(tmp_path, name)
    hf = hf_reference(path)
    references = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    one = LLM(path, dtype="float32", max_model_len=128)
    [whole_bytes] = _core(one).collective_rpc("parameter_bytes")
    [whole_kv] = _core(one).collective_rpc("bytes_per_block")
    one_tokens = _greedy(one)
    one.shutdown()
    two = LLM(path, dtype="float32", max_model_len=128, tensor_parallel_size=2)
    try:
        core = _core(two)
        assert isinstance(core.executor, MultiprocExecutor)
        two_tokens = _greedy(two)
        with pytest.raises(AttributeError, match="no public method"):
            core.collective_rpc("_bind_kv_cache")
        with pytest.raises(TypeError):  # raised everywhere; every worker's reply is read
            core.collective_rpc("bytes_per_block", (1,))
        worker_bytes = core.collective_rpc("parameter_bytes")
        worker_kv = core.collective_rpc("bytes_per_block")
        workers = core.executor.describe_workers()
    finally:
        two.shutdown()
    assert [(w.tp_rank, w.device) for w in workers] == [(0, "cpu"), (1, "cpu")]
    assert workers[0].pid == os.getpid() and workers[1].pid != os.getpid()
    assert two_tokens == one_tokens
    for i, (tokens, reference) in enumerate(zip(two_tokens, references, strict=True)):
        assert_greedy_matches(tokens, reference, label=f"{name} prompt {i}")
    # Only the norms (and a Mixtral's router) are held whole by both workers.
    assert len(worker_bytes) == 2
    for held in worker_bytes:
        assert 0.5 <= held / whole_bytes < 0.56, (held, whole_bytes)
    replicated_kv = CHECKPOINTS.get(name, {}).get("num_kv_heads") == 1
    assert worker_kv == [whole_kv if replicated_kv else whole_kv // 2] * 2


@pytest.mark.parametrize(
    ("size", "shape", "reason"),
    [
        (3, {}, "tensor_parallel_size 3 does not divide the model's 4 attention heads"),
        (4, {"num_heads": 12, "num_kv_heads": 3}, "4 is not a multiple of the model's 3 KV heads"),
        (2, {"num_heads": 6, "num_kv_heads": 3}, "2 does not divide the model's 3 KV heads"),
        (4, {"intermediate_size": 130}, "4 does not divide the model's MLP width 130"),
    ],
)
def test_a_tp_size_that_does_not_split_the_model_is_refused_before_any_process_starts(
    size: int, shape: dict[str, int], reason: str
) -> None:
    arch = ModelArch(
        "LlamaForCausalLM",
        vocab_size=100,
        hidden_size=96,
        intermediate_size=shape.get("intermediate_size", 128),
        num_hidden_layers=1,
        num_attention_heads=shape.get("num_heads", 4),
        num_key_value_heads=shape.get("num_kv_heads", 2),
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
    )
    config = EngineConfig.from_kwargs("unused", tensor_parallel_size=size)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=reason):
        make_executor(config, arch, max_model_len=64)
    assert set(multiprocessing.active_children()) <= before  # no worker was started


@pytest.mark.slow
def test_a_hung_worker_fails_the_step_and_a_dead_one_ends_the_ranks_process(
    tmp_path: Path,
) -> None:
    path = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    child, conn, [worker_pid] = start_tp2_engine(path, 2.0)
    try:
        os.kill(worker_pid, signal.SIGSTOP)
        conn.send("go")
        assert conn.poll(30), "the step never returned"
        outcome, elapsed = conn.recv()
        assert outcome != "finished"
        assert 1.5 < elapsed < 20  # the collective timeout (2 s), not the step's (300 s)
        os.kill(worker_pid, signal.SIGKILL)
        started = time.monotonic()
        child.join(20)
        assert not child.is_alive(), "the rank outlived its worker"
        assert time.monotonic() - started < 15  # ~0.5 s on a quiet machine
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker_pid, signal.SIGKILL)
        child.kill()
