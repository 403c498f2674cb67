"""The model runner on a CUDA device: HF parity in fp32, a sane bf16 run, and the engine core end
to end. Skipped without a GPU (the `gpu` marker); CI machines have none."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.core.engine_core import EngineCore
from shoal.engine.protocol import EngineCoreRequest, SamplingParams
from tests.engine.core_proc_utils import tiny_config
from tests.engine.model_utils import (
    ARCHITECTURES,
    BlockPool,
    Driver,
    RecordingSampler,
    assert_greedy_matches,
    assert_runner_matches_hf,
    greedy_generate,
    hf_greedy,
    make_hf_model,
    make_request,
    make_runner,
    random_prompts,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_cuda_greedy_matches_hf_on_the_cpu(architecture: str) -> None:
    hf_model = make_hf_model(architecture)
    runner = make_runner(hf_model, device="cuda")
    assert runner.device.type == "cuda"
    assert_runner_matches_hf(hf_model, runner, random_prompts([5, 17, 33, 9, 1]))


def test_bf16_on_cuda_stays_close_to_fp32() -> None:
    hf_model = make_hf_model("LlamaForCausalLM")
    prompts = random_prompts([24, 7])
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = make_runner(hf_model, device="cuda", dtype=dtype)
        _, recorder = greedy_generate(runner, prompts, 1)
        logits[dtype] = torch.stack([recorder.logits[f"r{i}"][0] for i in range(len(prompts))])
    assert torch.isfinite(logits["bfloat16"]).all()
    torch.testing.assert_close(logits["bfloat16"], logits["float32"], atol=0.1, rtol=0.05)


def test_engine_core_on_cuda_gives_the_same_tokens_alone_and_batched(
    engine_checkpoint: str,
) -> None:
    core = EngineCore(tiny_config(engine_checkpoint, device="cuda"))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = {
        f"r{i}": [(7 * i + 13 * j) % 200 + 1 for j in range(n)] for i, n in enumerate([40, 3, 17])
    }

    def run(request_ids: list[str]) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
        for rid in request_ids:
            core.add_request(
                EngineCoreRequest(
                    request_id=f"{rid}-{len(request_ids)}",
                    prompt_token_ids=prompts[rid],
                    sampling_params=params,
                    arrival_time=0.0,
                )
            )
        finished = 0
        while finished < len(request_ids):
            for outputs in core.step().values():
                for out in outputs.outputs:
                    rid = out.request_id.rsplit("-", 1)[0]
                    tokens[rid] += out.new_token_ids
                    finished += out.finish_reason is not None
        return tokens

    batched = run(list(prompts))
    for rid in prompts:
        assert run([rid]) == {rid: batched[rid]}


def test_cuda_defaults_to_triton() -> None:
    runner = make_runner(make_hf_model("LlamaForCausalLM"), device="cuda")
    assert runner.attention_backend.name == "TRITON_ATTN"


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "TORCH_SDPA"])
def test_cuda_prefill_chunks_and_decodes_give_hfs_tokens(backend: str) -> None:
    # Several prefill chunks per step (whole prompts, later chunks over a cached past) beside
    # decodes: the Triton kernel (CUDA's default) and the torch reference agree with HF.
    hf_model = make_hf_model("LlamaForCausalLM")
    runner = make_runner(hf_model, device="cuda", attention_backend=backend)
    runner.sampler = recorder = RecordingSampler()
    prompts = random_prompts([9, 33, 14, 1, 22], seed=11)
    driver = Driver(runner, BlockPool(runner.num_blocks, shuffle_seed=3))
    requests = [make_request(f"r{i}", p) for i, p in enumerate(prompts)]
    driver.generate(requests[:1], 2)
    driver.step([driver.schedule(requests[0], 1)] + [driver.schedule(r, 7) for r in requests[1:3]])
    tokens = driver.generate(requests, 5, chunk_size=10)
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = hf_greedy(hf_model, prompt, 5)
        ours = [row.cpu() for row in recorder.logits[f"r{i}"]]
        assert_greedy_matches(tokens[f"r{i}"], ours, ref_tokens, ref_logits)
