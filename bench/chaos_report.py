"""bench/chaos.py's record of a run: each stream as its client saw it, each fault, and the
summary printed at the end (verdicts against the greedy references, the longest stall after
each fault kind, throughput before, during and after the faults)."""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass, field

AFTER_FAULT_S = 10.0  # the "during" window after each fault


@dataclass
class Stream:
    """One request as its client saw it."""

    source: str  # "driver 0", "driver 1", "http"
    prompt: int  # index into PROMPTS
    started_at: float
    events: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    error: str | None = None
    finished_at: float = 0.0
    on_killed_front_end: bool = False


@dataclass
class Fault:
    kind: str
    at: float
    note: str = ""


def _verdict(stream: Stream, references: dict[int, list[int]], texts: dict[int, str]) -> str:
    if stream.error is not None:
        return "front_end" if stream.on_killed_front_end else "failed"
    if stream.source == "http":
        got, want = stream.text, texts[stream.prompt]
    else:
        got, want = stream.token_ids, references[stream.prompt]  # type: ignore[assignment]
    if got == want:
        return "ok"
    return "duplicated" if len(got) > len(want) and got[: len(want)] == want else "wrong"


def _longest_stall(streams: list[Stream], fault: Fault, window_s: float) -> float:
    longest = 0.0
    for s in streams:
        if not s.started_at < fault.at < (s.finished_at or float("inf")):
            continue
        times = [s.started_at] + [t for t, _ in s.events]
        for start, end in itertools.pairwise(times):
            if end >= fault.at and start <= fault.at + window_s:
                longest = max(longest, end - start)
    return longest


def _tokens_per_s(streams: list[Stream], start: float, end: float) -> float:
    tokens = sum(n for s in streams if s.source != "http" for t, n in s.events if start <= t < end)
    return tokens / max(end - start, 1e-9)


def print_report(
    args: argparse.Namespace,
    streams: list[Stream],
    faults: list[Fault],
    references: dict[int, list[int]],
    texts: dict[int, str],
    migrations: int,
    times: tuple[float, float, float],
) -> None:
    """The run's summary: verdicts, migrations, each fault kind's longest stall, throughput."""
    started, last, stopped = times
    verdicts: dict[str, int] = {}
    for s in streams:
        verdict = _verdict(s, references, texts)
        verdicts[verdict] = verdicts.get(verdict, 0) + 1
    print()
    print(f"{args.ranks} ranks, 2 drivers + 1 HTTP front end x {args.concurrency} streams of "
          f"{args.max_tokens} tokens, {args.minutes:g} min, {len(faults)} faults")  # fmt: skip
    print(f"requests started {len(streams)}, finished {verdicts.get('ok', 0)}, "
          f"failed {verdicts.get('failed', 0)}, duplicated {verdicts.get('duplicated', 0)}, "
          f"wrong {verdicts.get('wrong', 0)}; on a killed front end {verdicts.get('front_end', 0)}")  # fmt: skip
    print(f"migrations {migrations}")
    print()
    print(f"{'fault':<12}{'count':>6}{'longest stall':>15}")
    for kind in sorted({f.kind for f in faults}):
        window = AFTER_FAULT_S + (args.hang_s if kind == "hang" else 0.0)
        of_kind = [f for f in faults if f.kind == kind]
        stall = max(
            _longest_stall([s for s in streams if not s.on_killed_front_end], f, window)
            for f in of_kind
        )
        print(f"{kind:<12}{len(of_kind):>6}{stall:>14.2f}s")
    first = faults[0].at if faults else last
    during = [(f.at, f.at + AFTER_FAULT_S) for f in faults]
    during_tokens = sum(_tokens_per_s(streams, a, b) * (b - a) for a, b in during)
    print()
    print(f"driver tokens/s: before {_tokens_per_s(streams, started, first):.0f}, "
          f"during {during_tokens / max(AFTER_FAULT_S * len(during), 1e-9):.0f}, "
          f"after {_tokens_per_s(streams, last + AFTER_FAULT_S, stopped):.0f}")  # fmt: skip
