"""Batched next-token sampling over the rows of requests that sample this step.

Order per row, as in vLLM: the grammar's mask (structured outputs) -> logprobs (if asked) ->
min_tokens masking -> penalties (repetition, frequency, presence) -> greedy argmax, or
temperature -> min-p -> top-k -> top-p -> draw. A seeded request's draw for output position i
comes from a generator seeded by (seed, i) alone, so its tokens do not depend on batching or
preemption.
Knows nothing about the model or the scheduler; it only reads requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shoal.engine.protocol import SamplingParams, TokenLogprobs
from shoal.engine.request import Request
from shoal.engine.structured_output import fill_bitmasks

_MASK64 = (1 << 64) - 1
# Top-p looks for the nucleus among this many most likely tokens first, then among the wider
# count, and sorts the whole vocabulary only for rows whose nucleus is wider still.
_TOP_P_CANDIDATES = 256
_WIDE_TOP_P_CANDIDATES = 4096


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request did not ask


class Sampler:
    """Samples one token per row of a [num_rows, vocab] logits matrix.

    Args:
        seed: seeds the draws of requests without a seed of their own (vLLM's `--seed`): the
            same requests in the same order then get the same tokens. None: torch's global
            generator.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._generator = None if seed is None else torch.Generator().manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        grammar_bitmask: np.ndarray | None = None,
    ) -> SamplerOutput:
        """Samples one token for each request.

        Args:
            logits: [len(requests), vocab] raw logits; modified in place.
            requests: the requests in row order.
            grammar_bitmask: the allowed-token bitmask of each request with a grammar, in row
                order (`fill_bitmasks`); computed here when not given.

        Returns:
            The sampled token ids and, for requests with `logprobs` set, their logprobs.
        """
        assert logits.shape[0] == len(requests), "one logits row per request"
        logits = logits.float()
        _apply_grammars(logits, requests, grammar_bitmask)
        params = [r.sampling_params for r in requests]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # Logprobs of the raw distribution, before any masking or temperature (vLLM's default).
        raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
        _mask_min_tokens(logits, requests)
        _apply_penalties(logits, requests)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            token_ids = logits.argmax(dim=-1)
        elif len(random_rows) == len(params):
            token_ids = _sample_random(logits, requests, self._generator)
        else:
            token_ids = torch.empty(len(params), dtype=torch.long, device=logits.device)
            greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
            greedy = torch.tensor(greedy_rows, device=logits.device)
            token_ids[greedy] = logits.index_select(0, greedy).argmax(dim=-1)
            rows = torch.tensor(random_rows, device=logits.device)
            picked = [requests[i] for i in random_rows]
            token_ids[rows] = _sample_random(logits.index_select(0, rows), picked, self._generator)
        tokens: list[int] = token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for row, entry in zip(
                logprob_rows,
                _gather_logprobs(raw_logprobs, logprob_rows, tokens, params),
                strict=True,
            ):
                logprobs[row] = entry
        return SamplerOutput(tokens, logprobs)


def _apply_grammars(
    logits: torch.Tensor, requests: Sequence[Request], bitmask: np.ndarray | None
) -> None:
    """Sets the logits of the ids each request's grammar does not allow next to -inf."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return
    if bitmask is None:
        bitmask = fill_bitmasks([g for r in requests if (g := r.grammar) is not None])
    assert bitmask.shape[0] == len(rows), "one bitmask row per constrained request"
    vocab = logits.shape[1]
    # Little-endian words: byte k's bit j is id 8k + j, so unpacking the bytes in bit order
    # lays the ids out in order (a 0/1 byte per id, viewed as bool without a copy).
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = torch.from_numpy(bits.view(np.bool_)).to(logits.device)
    num_ids = allowed.shape[1]  # ids past the bitmask (none when it covers the vocabulary)
    if len(rows) == len(requests):
        logits[:, :num_ids].masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index)
    masked[:, :num_ids].masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, masked)


def _mask_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    vocab = logits.shape[1]
    for row, request in enumerate(requests):
        params = request.sampling_params
        # A grammar decides when the output may end: masking EOS could leave nothing allowed.
        if request.num_output_tokens >= params.min_tokens or request.grammar is not None:
            continue
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned += request.eos_token_ids
        # A stop id past the vocabulary can never be sampled: nothing to mask.
        banned = [t for t in banned if t < vocab]
        if banned:
            logits[row, banned] = float("-inf")


def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """vLLM's penalties: the repetition penalty divides the positive logits (multiplies the
    negative ones) of every token in the prompt or the output, as HF's processor does; the
    frequency penalty is subtracted per time a token was generated, the presence penalty once.
    """
    vocab = logits.shape[1]
    for row, request in enumerate(requests):
        params = request.sampling_params
        if not params.has_penalties:
            continue
        line = logits[row]
        output = torch.tensor(request.output_token_ids, dtype=torch.long, device=line.device)
        output = output[output < vocab]
        if params.repetition_penalty != 1.0:
            prompt = torch.tensor(request.prompt_token_ids, dtype=torch.long, device=line.device)
            seen = torch.cat([prompt[prompt < vocab], output]).unique()
            values = line[seen]
            penalty = params.repetition_penalty
            line[seen] = torch.where(values > 0, values / penalty, values * penalty)
        if (params.frequency_penalty or params.presence_penalty) and len(output):
            counts = torch.bincount(output, minlength=vocab).to(line.dtype)
            line -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> None:
    """Drops, per row, the tokens less likely than min_p times the likeliest one."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values
    threshold *= torch.tensor(min_p, dtype=probs.dtype, device=probs.device)[:, None]
    logits.masked_fill_(probs < threshold, float("-inf"))


def _sample_random(
    logits: torch.Tensor, requests: Sequence[Request], generator: torch.Generator | None
) -> torch.Tensor:
    """Draws from temperature-scaled, top-k / top-p truncated distributions by inverse CDF."""
    params = [r.sampling_params for r in requests]
    device, vocab = logits.device, logits.shape[1]
    logits.div_(torch.tensor([p.temperature for p in params], device=device)[:, None])
    if any(p.min_p > 0.0 for p in params):
        _apply_min_p(logits, [p.min_p for p in params])
    uniforms = _uniforms(requests, generator).to(device)
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    truncated = [i for i, p in enumerate(params) if top_k[i] or p.top_p < 1.0]
    if not truncated:
        return _draw_full(logits, uniforms)
    tokens = torch.empty(len(params), dtype=torch.long, device=device)
    is_truncated = set(truncated)
    plain = [i for i in range(len(params)) if i not in is_truncated]
    if plain:
        rows = torch.tensor(plain, device=device)
        tokens[rows] = _draw_full(logits.index_select(0, rows), uniforms.index_select(0, rows))
    rows = torch.tensor(truncated, device=device)
    tokens[rows] = _draw_truncated(
        logits.index_select(0, rows),
        [top_k[i] for i in truncated],
        [params[i].top_p for i in truncated],
        uniforms.index_select(0, rows),
    )
    return tokens


def _draw_full(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw over the whole vocabulary (unnormalised: the CDF's end scales u)."""
    weights = (logits - logits.max(dim=-1, keepdim=True).values).exp_()
    return _invert_cdf(weights, uniforms)


def _draw_truncated(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], uniforms: torch.Tensor
) -> torch.Tensor:
    """Top-k then top-p, working on each row's most likely tokens instead of the whole vocab.

    Without top-k, a row's nucleus is looked for among `_TOP_P_CANDIDATES` tokens; rows whose
    nucleus is wider (a flat distribution) retry with more, then with a full sort.
    """
    device, vocab = logits.device, logits.shape[1]
    k_eff = [k or _TOP_P_CANDIDATES for k in top_k]
    num_candidates = min(vocab, max(k_eff))
    values, ids = logits.topk(num_candidates, dim=-1)
    k_t = torch.tensor(k_eff, device=device).clamp_(max=num_candidates)
    has_k = torch.tensor([k > 0 for k in top_k], device=device)
    values.masked_fill_(
        torch.arange(num_candidates, device=device)[None, :] >= k_t[:, None], float("-inf")
    )
    # Top-p applies to the top-k renormalised distribution, else to the whole vocabulary's.
    log_norm = torch.logsumexp(values, dim=-1)
    if not all(top_k):
        log_norm = torch.where(has_k, log_norm, torch.logsumexp(logits, dim=-1))
    p_t = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], device=device)
    tokens, covered = _draw_nucleus(values, ids, log_norm, p_t, uniforms)
    wide = (~covered & ~has_k).nonzero().flatten()
    for num_candidates in (_WIDE_TOP_P_CANDIDATES, vocab):
        if not len(wide):
            break
        rows = logits.index_select(0, wide)
        if num_candidates < vocab:
            values, ids = rows.topk(num_candidates, dim=-1)
        else:
            values, ids = rows.sort(dim=-1, descending=True)
        drawn, covered = _draw_nucleus(
            values, ids, log_norm[wide], p_t[wide], uniforms.index_select(0, wide)
        )
        done = covered | (num_candidates >= vocab)
        tokens[wide[done]] = drawn[done]
        wide = wide[~done]
    return tokens


def _draw_nucleus(
    values: torch.Tensor,
    ids: torch.Tensor,
    log_norm: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws among sorted candidates, keeping the smallest prefix whose mass reaches top_p.

    Returns the token ids and, per row, whether the candidates held that much mass at all.
    """
    probs = (values - log_norm[:, None]).exp_()
    cum = probs.cumsum(dim=-1)
    covered = cum[:, -1] >= top_p
    # A token is kept while the mass before it is still short of top_p (so the first always is).
    probs.masked_fill_((cum - probs) >= top_p[:, None], 0.0)
    picked = _invert_cdf(probs, uniforms)
    return ids.gather(1, picked[:, None]).squeeze(1), covered


def _invert_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index drawn with probability proportional to the non-negative `weights` of each row."""
    cdf = weights.cumsum(dim=-1)
    targets = uniforms * cdf[:, -1]
    picked = torch.searchsorted(cdf, targets[:, None], right=True).clamp_(max=weights.shape[1] - 1)
    bad = (weights.gather(1, picked) <= 0).squeeze(1)
    if bad.any():
        # u * total rounded up to the total: take the last token with weight instead.
        last = (weights[bad] > 0).cumsum(dim=-1).argmax(dim=-1, keepdim=True)
        picked[bad] = last
    return picked.squeeze(1)


def _uniforms(requests: Sequence[Request], generator: torch.Generator | None) -> torch.Tensor:
    """A U[0, 1) draw per request: from (seed, output position) when seeded, else from
    `generator` (torch's global one when None)."""
    out = torch.rand(len(requests), generator=generator)
    for row, request in enumerate(requests):
        seed = request.sampling_params.seed
        if seed is not None:
            gen = torch.Generator().manual_seed(draw_seed(seed, request.num_output_tokens))
            out[row] = torch.rand(1, generator=gen)[0]
    return out


def draw_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed for output position `position` of a request seeded `seed`."""
    return _splitmix64((_splitmix64(seed & _MASK64) + position) & _MASK64)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _gather_logprobs(
    logprobs: torch.Tensor,
    rows: list[int],
    tokens: list[int],
    params: Sequence[SamplingParams],
) -> list[TokenLogprobs]:
    """TokenLogprobs for `rows` from their raw log-softmax rows (in `rows` order)."""
    sampled = torch.tensor([tokens[r] for r in rows], device=logprobs.device)
    sampled_lp = logprobs.gather(1, sampled[:, None])
    # Rank counts tokens at least as likely, the sampled one included (1 = the argmax).
    ranks = (logprobs >= sampled_lp).sum(dim=-1).tolist()
    num_top = [params[r].logprobs or 0 for r in rows]
    top_values, top_ids = logprobs.topk(max(max(num_top), 1), dim=-1)
    top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    sampled_lp_list = sampled_lp.squeeze(1).tolist()
    return [
        TokenLogprobs(
            token_ids=[tokens[r], *top_ids_list[j][: num_top[j]]],
            logprobs=[sampled_lp_list[j], *top_values_list[j][: num_top[j]]],
            sampled_rank=ranks[j],
        )
        for j, r in enumerate(rows)
    ]
