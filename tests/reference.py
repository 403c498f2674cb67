"""HF transformers as the numerical reference: greedy decoding with the logit margin per step."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

# Where HF's own top-2 logits are closer than this, a different argmax is a tie, not a bug.
TIE_MARGIN = 1e-3


@dataclass
class GreedyTrace:
    token_ids: list[int]
    margins: list[float]  # top-1 minus top-2 logit at each generated position


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> GreedyTrace:
    """Greedy decoding with HF's KV cache, one prompt at a time (no padding), no EOS stop."""
    # transformers 5 renamed the cache argument; 4.x only knows past_key_values.
    cache_arg = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    input_ids = torch.tensor([prompt_ids])
    out = model(input_ids=input_ids, use_cache=True)
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(max_new_tokens):
        logits = out.logits[0, -1].float()
        top2 = torch.topk(logits, 2)
        tokens.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        step = {cache_arg: out.past_key_values, "use_cache": True}
        out = model(input_ids=torch.tensor([[tokens[-1]]]), **step)
    return GreedyTrace(tokens, margins)


def assert_greedy_matches(actual: list[int], reference: GreedyTrace, *, label: str = "") -> int:
    """Asserts token identity up to the first position where HF itself was at a near-tie.

    Returns:
        How many tokens were compared (all of them unless a tie ended the comparison).
    """
    for i, (got, want) in enumerate(zip(actual, reference.token_ids, strict=False)):
        if got != want:
            assert reference.margins[i] < TIE_MARGIN, (
                f"{label}: token {i} differs ({got} != {want}) with HF margin "
                f"{reference.margins[i]:.2e}\n  got  {actual}\n  want {reference.token_ids}"
            )
            return i
    assert len(actual) == len(reference.token_ids), f"{label}: length {len(actual)}"
    return len(actual)


def assert_resumed_greedy_matches(
    model: torch.nn.Module, prompt_ids: list[int], actual: list[int], *, label: str = ""
) -> None:
    """A greedy request that moved once to another rank, mid-decode: HF's greedy tokens up to the
    first place they part, then, from there, HF's greedy continuation of the request's own
    tokens so far.

    The new rank recomputed the request's whole prefix in one pass, where HF decoded it a token
    at a time. In a mixture-of-experts model a router near-tie in that prefix can send a token
    to another expert, which moves the next logits by more than any float tie: the reference
    for what follows is HF's recomputation of the same prefix (its first forward is one pass
    over it). A token lost or repeated in the move still fails, as the continuation of a wrong
    prefix.
    """
    reference = hf_greedy(model, prompt_ids, len(actual))
    parted = next(
        (i for i, (a, b) in enumerate(zip(actual, reference.token_ids, strict=True)) if a != b),
        None,
    )
    if parted is None:
        return
    resumed = hf_greedy(model, prompt_ids + actual[:parted], len(actual) - parted)
    assert_greedy_matches(actual[parted:], resumed, label=f"{label} (after token {parted})")
