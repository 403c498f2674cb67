"""Tensor parallelism over NCCL: two workers on two GPUs give the one-GPU engine's greedy tokens.
Behind the `gpu` marker, and skipped on a machine with fewer than two GPUs (one worker per GPU:
NCCL does not put two ranks of a group on one device)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.client.api.llm import LLM
from shoal.engine.protocol import SamplingParams
from tests.factories import Arch, make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="NCCL tensor parallelism needs two GPUs",
    ),
]


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_two_gpus_give_one_gpus_greedy_tokens(tmp_path: Path, arch: Arch) -> None:
    path = make_tiny_checkpoint(tmp_path / "ckpt", arch)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 3, 40]}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = []
    for tp in (1, 2):
        llm = LLM(path, device="cuda", dtype="float32", max_model_len=128, tensor_parallel_size=tp)
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
        tokens.append([list(out.outputs[0].token_ids) for out in outputs])
    assert tokens[0] == tokens[1]
