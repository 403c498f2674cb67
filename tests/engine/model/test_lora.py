"""LoRA in shoal's engine: greedy tokens equal HF's with each adapter merged into the base by
hand, for adapters alone and mixed with other adapters and the base in one batch, on Llama and
Qwen2; adapters that do not fit fail their request only."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.lora.config import LoRAConfig
from shoal.engine.protocol import EngineCoreRequest, FinishReason, LoRARequest, SamplingParams
from tests.factories import hf_reference, make_tiny_checkpoint, make_tiny_gguf
from tests.lora_factories import (
    ATTENTION_MODULES,
    MLP_MODULES,
    make_lora_adapter,
    merged_reference,
    write_adapter_config,
)
from tests.reference import assert_greedy_matches, hf_greedy

MAX_TOKENS = 8
PROMPTS = [[5, 9, 14, 3, 22, 7], [11, 4, 30, 2], [8, 8, 19, 27, 6, 12, 40, 3, 1]]


def _lora(name: str, path: str) -> LoRARequest:
    return LoRARequest(name, abs(hash(name)) % 1000 + 1, path)


def _run(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, tuple[list[int], str]]:
    """Adds every request before the first step (one batch) and runs them, and any added
    before, to the end."""
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    errors: dict[str, str] = {}
    while core.has_unfinished_requests():
        for frame in core.step().values():
            for out in frame.outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason == FinishReason.ERROR:
                    errors[out.request_id] = out.error_message or ""
    return {rid: (toks, errors.get(rid, "")) for rid, toks in tokens.items()}


def _request(rid: str, prompt: list[int], lora: LoRARequest | None) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return EngineCoreRequest(rid, prompt, params, lora_request=lora)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def base(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp(request.param)
    path = make_tiny_checkpoint(root / "base", request.param, seed=3)
    adapters = {
        "all": make_lora_adapter(root / "all", path, seed=1, rank=4, alpha=8),
        "attn": make_lora_adapter(
            root / "attn", path, target_modules=ATTENTION_MODULES, seed=2, rank=8, alpha=4
        ),
        "mlp-qv": make_lora_adapter(
            root / "mlp-qv",
            path,
            target_modules=(*MLP_MODULES, "q_proj", "v_proj"),
            seed=3,
            rank=2,
            alpha=16,
            layers=[1],
        ),
    }
    return {"path": path, "adapters": adapters, "root": root}


@pytest.fixture(scope="module")
def core(base: dict) -> EngineCore:
    config = EngineConfig.from_kwargs(
        base["path"], max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8
    )
    return EngineCore(config)


def _references(base: dict) -> dict[str | None, list[list[int]]]:
    """Per adapter (None: the base), HF's greedy tokens for every prompt."""
    models = {None: hf_reference(base["path"])}
    models.update({n: merged_reference(base["path"], p) for n, p in base["adapters"].items()})
    return {
        name: [hf_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS]  # type: ignore[misc]
        for name, model in models.items()
    }


def test_each_adapter_alone_and_all_mixed_match_hf_merged(core: EngineCore, base: dict) -> None:
    refs = _references(base)
    adapters = base["adapters"]
    for name, path in adapters.items():  # each alone, every prompt in one batch
        got = _run(
            core, [_request(f"{name}-{i}", p, _lora(name, path)) for i, p in enumerate(PROMPTS)]
        )
        for i in range(len(PROMPTS)):
            toks, error = got[f"{name}-{i}"]
            assert not error
            assert_greedy_matches(toks, refs[name][i], label=f"{name} prompt {i}")
    # Two adapters and the base in one batch (max_loras=2), then the third adapter evicts one.
    names: list[str | None] = ["all", None, "attn", "all", None, "attn", "mlp-qv"]
    requests = [
        _request(f"mix-{i}", PROMPTS[i % 3], None if n is None else _lora(n, adapters[n]))
        for i, n in enumerate(names)
    ]
    got = _run(core, requests)
    for i, name in enumerate(names):
        toks, error = got[f"mix-{i}"]
        assert not error
        assert_greedy_matches(toks, refs[name][i % 3], label=f"mixed {name} prompt {i % 3}")


def test_the_base_differs_from_an_adapter(base: dict) -> None:
    """The adapters are not no-ops: HF's merged model disagrees with the base somewhere."""
    refs = _references(base)
    for name in base["adapters"]:
        assert [r.token_ids for r in refs[name]] != [r.token_ids for r in refs[None]], name


def test_adapters_that_do_not_fit_fail_their_request_only(core: EngineCore, base: dict) -> None:
    root: Path = base["root"]
    big = make_lora_adapter(root / "big", base["path"], rank=16, alpha=16)
    bad_config = make_lora_adapter(root / "dora", base["path"], rank=2)
    write_adapter_config(bad_config, r=2, lora_alpha=2, use_dora=True)
    requests = [
        _request("big", PROMPTS[0], _lora("big", big)),
        _request("missing", PROMPTS[0], _lora("missing", str(root / "nowhere"))),
        _request("dora", PROMPTS[0], _lora("dora", bad_config)),
        _request("ok", PROMPTS[0], None),
    ]
    got = _run(core, requests)
    assert "above --max-lora-rank 8" in got["big"][1]
    assert "is not a directory" in got["missing"][1]
    assert "use_dora=True is not supported" in got["dora"][1]
    assert got["ok"][1] == "" and len(got["ok"][0]) == MAX_TOKENS


def test_a_module_the_base_lacks_is_refused(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "base", "llama")
    adapter = make_lora_adapter(tmp_path / "embed", path, target_modules=("lm_head",), rank=2)
    core = EngineCore(EngineConfig.from_kwargs(path, max_model_len=64, enable_lora=True))
    got = _run(core, [_request("head", [4, 5], _lora("head", adapter))])
    assert "'lm_head', which the base model cannot adapt" in got["head"][1]


def test_an_adapter_on_an_engine_without_lora_is_refused(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "base", "llama")
    adapter = make_lora_adapter(tmp_path / "a", path, rank=2)
    core = EngineCore(EngineConfig.from_kwargs(path, max_model_len=64))
    got = _run(core, [_request("a", [4, 5], _lora("a", adapter)), _request("b", [4, 5], None)])
    assert "not enabled" in got["a"][1] and got["b"][1] == ""


def _mixed_batch_matches_hf(core: EngineCore, base_path: str, adapters: dict[str, str]) -> None:
    models = {None: hf_reference(base_path)}
    models.update({n: merged_reference(base_path, p) for n, p in adapters.items()})
    names: list[str | None] = [*adapters, None, *adapters]
    requests = [
        _request(f"r{i}", PROMPTS[i % 3], None if n is None else _lora(n, adapters[n]))
        for i, n in enumerate(names)
    ]
    got = _run(core, requests)
    for i, name in enumerate(names):
        toks, error = got[f"r{i}"]
        assert not error
        reference = hf_greedy(models[name], PROMPTS[i % 3], MAX_TOKENS)
        assert_greedy_matches(toks, reference, label=f"{name} prompt {i % 3}")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_tensor_parallel_workers_match_hf_merged(tmp_path: Path, arch: str) -> None:
    """A/B sharded like their layers: q/k/v, gate/up (column-parallel) split B's rows, o and
    down (row-parallel) split A's columns and join the all-reduce."""
    path = make_tiny_checkpoint(tmp_path / "base", arch, seed=5)
    adapters = {
        "all": make_lora_adapter(tmp_path / "all", path, seed=6, rank=4, alpha=8),
        "attn": make_lora_adapter(
            tmp_path / "attn", path, target_modules=ATTENTION_MODULES, seed=7, rank=8
        ),
    }
    config = EngineConfig.from_kwargs(
        path, max_model_len=128, enable_lora=True, max_loras=2, tensor_parallel_size=2
    )
    core = EngineCore(config)
    try:
        _mixed_batch_matches_hf(core, path, adapters)
    finally:
        core.shutdown()


def test_a_gguf_base_takes_adapters(tmp_path: Path) -> None:
    """Its projections compute from the GGUF blocks; the adapters add to their outputs."""
    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", "llama", seed=8)
    gguf = make_tiny_gguf(tmp_path / "tiny.gguf", checkpoint, qtype="Q8_0")
    adapters = {"all": make_lora_adapter(tmp_path / "all", checkpoint, seed=9, rank=4)}
    core = EngineCore(EngineConfig.from_kwargs(gguf, max_model_len=128, enable_lora=True))
    _mixed_batch_matches_hf(core, gguf, adapters)


@pytest.mark.parametrize(("max_cpu_loras", "num_reads"), [(None, 6), (3, 3)])
def test_adapters_kept_in_cpu_memory_are_not_read_again(
    base: dict, max_cpu_loras: int | None, num_reads: int
) -> None:
    """One slot, three adapters in turn, twice: six loads, all but the first evicting the one
    before; from disk each time, or once each when CPU memory keeps all three."""
    adapters = base["adapters"]
    config = EngineConfig.from_kwargs(
        base["path"], max_model_len=128, enable_lora=True, max_loras=1, max_lora_rank=8,
        max_cpu_loras=max_cpu_loras,
    )  # fmt: skip
    core = EngineCore(config)
    refs = {
        n: hf_greedy(merged_reference(base["path"], p), PROMPTS[0], MAX_TOKENS)
        for n, p in adapters.items()
    }
    for turn in range(2):
        for name, path in adapters.items():
            (toks, error) = _run(core, [_request(f"{name}{turn}", PROMPTS[0], _lora(name, path))])[
                f"{name}{turn}"
            ]
            assert not error
            assert_greedy_matches(toks, refs[name], label=f"{name} turn {turn}")
    assert core.collective_rpc("lora_disk_reads") == [num_reads]
    stats = core.scheduler.make_stats()
    assert stats.num_lora_loads_total == 6 and stats.lora_live == ["mlp-qv"]
    assert stats.num_lora_evictions_total == 5 and stats.lora_load_seconds_total > 0
    assert stats.lora_cached == (["all", "attn", "mlp-qv"] if max_cpu_loras else ["mlp-qv"])


def test_max_cpu_loras_below_max_loras_is_refused() -> None:
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_an_adapter_broken_after_its_check_fails_its_requests_not_the_engine(
    base: dict, tmp_path: Path
) -> None:
    """Its folder changes between the request's check and the step that loads it."""
    path = make_lora_adapter(tmp_path / "fragile", base["path"], seed=4, rank=2)
    weights = Path(path) / "adapter_model.safetensors"
    good = weights.read_bytes()
    config = EngineConfig.from_kwargs(base["path"], max_model_len=128, enable_lora=True)
    core = EngineCore(config)
    lora = _lora("fragile", path)
    core.add_request(_request("fragile", PROMPTS[0], lora))
    core.add_request(_request("base", PROMPTS[1], None))
    weights.write_bytes(good[:100])  # checked already; truncated before it loads
    got = _run(core, [])
    assert "could not be loaded" in got["fragile"][1] and got["fragile"][0] == []
    assert got["base"][1] == "" and len(got["base"][0]) == MAX_TOKENS
    weights.write_bytes(good)  # mended: it loads afresh, and is right
    toks, error = _run(core, [_request("again", PROMPTS[0], lora)])["again"]
    assert not error
    assert_greedy_matches(
        toks, hf_greedy(merged_reference(base["path"], path), PROMPTS[0], MAX_TOKENS)
    )
