"""Sampler: greedy, temperature / min-p / top-k / top-p, seeds, min_tokens, penalties, logprobs."""

from __future__ import annotations

import msgspec
import pytest
import torch

from shoal.engine.model.sampler import Sampler, _apply_penalties, draw_seed
from shoal.engine.protocol import SamplingParams
from shoal.engine.request import Request

VOCAB = 64


def _request(
    params: SamplingParams, *, num_outputs: int = 0, eos: tuple[int, ...] = (), rid: str = "r"
) -> Request:
    request = Request(rid, [1, 2, 3], params, eos_token_ids=eos)
    for _ in range(num_outputs):
        request.append_output_token(5)
    return request


def _logits(rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    return Sampler()(logits.clone(), requests).token_ids


def test_greedy_is_argmax() -> None:
    logits = _logits(5)
    requests = [_request(SamplingParams(temperature=0.0)) for _ in range(5)]
    assert _sample(logits, requests) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)],
    ids=["top_k=1", "tiny top_p"],
)
def test_truncation_to_one_token_is_greedy(params: SamplingParams) -> None:
    logits = _logits(8, seed=1)
    assert _sample(logits, [_request(params) for _ in range(8)]) == logits.argmax(-1).tolist()


def test_greedy_and_random_rows_mix() -> None:
    logits = _logits(6, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 3
    tokens = _sample(logits, [_request(p) for p in params])
    assert tokens[0::2] == logits[0::2].argmax(-1).tolist()


def _seeded_tokens(seed: int, logits: torch.Tensor, *, batch_with_others: bool) -> list[int]:
    """Ten draws at output positions 0..9 of one seeded request, alone or among others."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    tokens = []
    for position in range(10):
        request = _request(params, num_outputs=position)
        if not batch_with_others:
            tokens.append(_sample(logits[position : position + 1], [request])[0])
            continue
        others = [_request(SamplingParams(temperature=0.7)), _request(SamplingParams(seed=99))]
        rows = torch.cat([logits[:2], logits[position : position + 1]])
        tokens.append(_sample(rows, [*others, request])[2])
    return tokens


def test_seeded_draws_do_not_depend_on_batching_or_recompute() -> None:
    logits = _logits(10, seed=4, scale=1.0)
    alone = _seeded_tokens(7, logits, batch_with_others=False)
    assert alone == _seeded_tokens(7, logits, batch_with_others=True)
    # After a preemption the request recomputes and samples the same positions again.
    assert alone == _seeded_tokens(7, logits, batch_with_others=False)
    assert alone != _seeded_tokens(8, logits, batch_with_others=False)
    assert len(set(alone)) > 3  # a flat distribution: the draws really vary


def test_an_engine_seed_repeats_the_draws_of_unseeded_requests() -> None:
    """vLLM's --seed: the same unseeded requests in the same order draw the same tokens; a
    request's own seed still decides its draws."""
    logits = _logits(16, seed=4, scale=1.0)

    def run(sampler: Sampler) -> list[list[int]]:
        steps = []
        for _ in range(5):
            requests = [_request(SamplingParams(temperature=1.0)) for _ in range(16)]
            steps.append(sampler(logits.clone(), requests).token_ids)
        return steps

    assert run(Sampler(seed=7)) == run(Sampler(seed=7))
    assert run(Sampler(seed=7)) != run(Sampler(seed=8))
    own = [_request(SamplingParams(temperature=1.0, seed=3)) for _ in range(16)]
    assert (
        Sampler(seed=7)(logits.clone(), own).token_ids
        == Sampler(seed=8)(logits.clone(), own).token_ids
    )


def test_draw_seed_mixes_seed_and_position() -> None:
    seeds = {draw_seed(s, p) for s in range(50) for p in range(50)}
    assert len(seeds) == 2500
    assert draw_seed(-1, 0) == draw_seed(2**64 - 1, 0)  # negative seeds wrap, never raise


def _frequencies(params: SamplingParams, logits: torch.Tensor, num_draws: int) -> torch.Tensor:
    """Token frequencies over `num_draws` rows, each seeded differently (deterministic)."""
    requests = [
        _request(msgspec.structs.replace(params, seed=i), rid=str(i)) for i in range(num_draws)
    ]
    tokens = _sample(logits.expand(num_draws, -1), requests)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / num_draws


def _params(**kwargs: object) -> SamplingParams:
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_temperature_distribution_matches_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -8.0]])
    for temperature in (0.5, 1.0, 2.0):
        expected = torch.softmax(logits[0] / temperature, dim=-1)
        freq = _frequencies(_params(temperature=temperature), logits, 4000)
        chi2 = float((((freq - expected) ** 2) / expected.clamp(min=1e-3)).sum() * 4000)
        assert chi2 < 25.0, (temperature, freq, expected)  # 5 dof: p < 1e-4


def test_top_k_then_top_p_on_the_renormalised_distribution() -> None:
    # probs 0.5, 0.3, 0.2: top_k=2 renormalises to 0.625 / 0.375, so top_p=0.6 keeps one token
    # (on the raw distribution it would need two).
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    freq = _frequencies(_params(temperature=1.0, top_k=2, top_p=0.6), logits, 300)
    assert freq.tolist() == [1.0, 0.0, 0.0]
    freq = _frequencies(_params(temperature=1.0, top_p=0.6), logits, 2000)
    assert freq[2] == 0.0 and 0.55 < freq[0] < 0.70  # 0.5 / 0.8 of the mass


@pytest.mark.parametrize("vocab", [100, 3000, 20000], ids=["narrow", "wide", "full-sort"])
def test_top_p_keeps_exactly_the_nucleus(vocab: int) -> None:
    # A flat distribution exercises every candidate tier: 256, then 4096, then a full sort.
    logits = torch.linspace(0.0, 1.0, vocab)[None] + torch.randn(1, vocab) * 0.01
    probs = torch.softmax(logits[0], dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    num_kept = int(((sorted_probs.cumsum(0) - sorted_probs) < 0.9).sum())
    nucleus = set(order[:num_kept].tolist())
    freq = _frequencies(_params(temperature=1.0, top_p=0.9), logits, 400)
    drawn = set(freq.nonzero().flatten().tolist())
    assert drawn <= nucleus
    assert len(drawn) > min(100, num_kept // 2)


def test_top_k_draws_only_the_k_most_likely() -> None:
    logits = _logits(1, seed=5, scale=0.5)
    top5 = set(logits[0].topk(5).indices.tolist())
    freq = _frequencies(_params(temperature=1.0, top_k=5), logits, 500)
    assert set(freq.nonzero().flatten().tolist()) == top5


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 9], logits[0, 11] = 10.0, 9.0, 8.0  # EOS 7, stop token 9
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    assert _sample(logits, [_request(params, num_outputs=2, eos=(7,))]) == [11]
    assert _sample(logits, [_request(params, num_outputs=3, eos=(7,))]) == [7]
    ignore = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9], ignore_eos=True)
    assert _sample(logits, [_request(ignore, num_outputs=0, eos=(7,))]) == [7]
    plain = SamplingParams(temperature=0.0, stop_token_ids=[9])
    assert _sample(logits, [_request(plain, num_outputs=0, eos=(7,))]) == [7]
    outside = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[10**6])
    assert _sample(logits, [_request(outside, num_outputs=0, eos=(7,))]) == [9]


def test_repetition_penalty_is_hfs_over_prompt_and_output() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = _logits(1, seed=7)
    request = _request(SamplingParams(repetition_penalty=1.7), num_outputs=3)  # outputs 5, 5, 5
    request.append_output_token(40)
    expected = RepetitionPenaltyLogitsProcessor(1.7)(
        torch.tensor([[1, 2, 3, 5, 5, 5, 40]]), logits.clone()
    )
    penalized = logits.clone()
    _apply_penalties(penalized, [request])
    torch.testing.assert_close(penalized, expected)


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    request = _request(params, num_outputs=3)  # prompt 1, 2, 3; outputs 5, 5, 5
    request.append_output_token(9)
    _apply_penalties(logits, [request])
    expected = torch.zeros(1, VOCAB)
    expected[0, 5] = -(0.5 * 3 + 0.25)
    expected[0, 9] = -(0.5 + 0.25)
    torch.testing.assert_close(logits, expected)  # prompt tokens 1, 2, 3 untouched


def test_penalties_steer_greedy_and_leave_other_rows_alone() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5], logits[:, 6] = 2.0, 1.5
    penalized = _request(SamplingParams(temperature=0.0, presence_penalty=1.0), num_outputs=1)
    plain = _request(SamplingParams(temperature=0.0), num_outputs=1)
    assert _sample(logits, [penalized, plain]) == [6, 5]


def test_min_p_drops_tokens_below_its_share_of_the_top_one() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    freq = _frequencies(_params(temperature=1.0, min_p=0.2), logits, 2000)  # below 0.1 goes
    assert freq[3] == 0.0 and all(f > 0.0 for f in freq[:3].tolist())
    freq = _frequencies(_params(temperature=1.0, min_p=0.7), logits, 300)
    assert freq.tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("nan")},
        {"min_p": 1.5},
        {"min_p": -0.1},
    ],
    ids=str,
)
def test_out_of_range_penalties_and_min_p_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = _logits(3, seed=6)
    params = [
        SamplingParams(temperature=0.0, logprobs=4),
        SamplingParams(temperature=2.0, top_k=3, seed=1, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler()(logits.clone(), [_request(p) for p in params])
    expected = torch.log_softmax(logits, dim=-1)
    first, second, third = out.logprobs
    assert third is None
    assert first is not None and second is not None
    assert first.token_ids == [out.token_ids[0], *expected[0].topk(4).indices.tolist()]
    torch.testing.assert_close(torch.tensor(first.logprobs[1:]), expected[0].topk(4).values)
    assert first.sampled_rank == 1
    # Temperature and top-k shape the draw, never the reported logprobs.
    sampled = out.token_ids[1]
    assert second.token_ids == [sampled]
    assert second.logprobs == pytest.approx([float(expected[1, sampled])], abs=1e-5)
    assert second.sampled_rank == int((expected[1] >= expected[1, sampled]).sum())
    assert second.sampled_rank <= 3
