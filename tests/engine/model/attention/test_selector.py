"""The backend is picked once, by name or by device; a name that cannot serve is an error."""

from __future__ import annotations

import argparse

import pytest
import torch

from shoal.engine.config import (
    ATTENTION_BACKENDS,
    EngineConfig,
    ModelConfig,
    add_engine_cli_args,
    engine_kwargs_from_cli,
)
from shoal.engine.kernels.paged_attention import DISABLE_ENV
from shoal.engine.model.attention import select_attention_backend

CPU = torch.device("cpu")


def _select(name: str | None, **overrides) -> str:
    kwargs = {
        "device": CPU,
        "dtype": torch.float32,
        "num_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 64,
        **overrides,
    }
    return select_attention_backend(name, **kwargs).name


def test_every_name_selects_its_backend() -> None:
    assert set(ATTENTION_BACKENDS) == {"CPU_ATTN", "TORCH_SDPA", "TRITON_ATTN"}
    for name in ATTENTION_BACKENDS:
        if name == "TRITON_ATTN" and torch.cuda.is_available():
            continue  # on CPU it needs the interpreter, which is off in a CUDA process
        assert _select(name) == name


def test_cpu_default_is_the_c_kernels_else_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _select(None) == "CPU_ATTN"
    # fp16 and groups past the kernel's bound are not the C kernels' to serve.
    assert _select(None, dtype=torch.float16) == "TORCH_SDPA"
    assert _select(None, num_heads=130, num_kv_heads=1) == "TORCH_SDPA"
    with pytest.raises(ValueError, match="CPU_ATTN cannot serve"):
        _select("CPU_ATTN", dtype=torch.float16)
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert _select(None) == "TORCH_SDPA"


def test_unknown_names_are_refused_at_config_time() -> None:
    with pytest.raises(ValueError, match="unknown attention_backend 'FLASH_ATTN'"):
        ModelConfig(model="m", attention_backend="FLASH_ATTN")
    with pytest.raises(ValueError, match="unknown attention backend"):
        _select("flash")
    config = EngineConfig.from_kwargs("m", attention_backend="TORCH_SDPA")
    assert config.model.attention_backend == "TORCH_SDPA"


@pytest.mark.gpu
def test_cuda_default_is_triton_and_c_kernels_stay_on_cpu() -> None:
    assert _select(None, device=torch.device("cuda")) == "TRITON_ATTN"
    with pytest.raises(ValueError, match="CPU only"):
        _select("CPU_ATTN", device=torch.device("cuda"))


def test_the_cli_flag_reaches_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    args = parser.parse_args(["--attention-backend", "TRITON_ATTN"])
    assert engine_kwargs_from_cli(args)["attention_backend"] == "TRITON_ATTN"
    assert engine_kwargs_from_cli(parser.parse_args([]))["attention_backend"] is None
