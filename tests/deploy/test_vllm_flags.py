"""vLLM's 40 most used serve flags on `shoal serve`, each checked from the one table in
`shoal.deploy.flags`: served, accepted, accepted at one value, or refused in one line."""

from __future__ import annotations

import argparse

import pytest

from shoal.deploy import cli
from shoal.deploy.flags import VLLM_SERVE_FLAGS, Verdict, VllmFlag


def _serve_parser() -> argparse.ArgumentParser:
    subparsers = next(
        a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    return subparsers.choices["serve"]


def _action(parser: argparse.ArgumentParser, name: str) -> argparse.Action:
    return next(a for a in parser._actions if name in a.option_strings)


def test_the_table_holds_forty_distinct_flags_each_in_the_help() -> None:
    names = [name for flag in VLLM_SERVE_FLAGS for name in flag.names]
    assert len(VLLM_SERVE_FLAGS) == 40 and len(names) == len(set(names))
    text = _serve_parser().format_help()
    assert all(name in text for name in names)


def _id(flag: VllmFlag) -> str:
    return flag.names[0]


@pytest.mark.parametrize("flag", VLLM_SERVE_FLAGS, ids=_id)
def test_each_flag_is_served_accepted_or_refused_in_one_line(
    flag: VllmFlag, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = _serve_parser()
    argv = ["/models/llama", *flag.example]
    if flag.verdict in (Verdict.SERVED, Verdict.ACCEPTED):
        args = parser.parse_args(argv)
        action = _action(parser, flag.names[0])
        if flag.verdict == Verdict.SERVED:  # wired to a feature: the value arrives
            assert getattr(args, action.dest) != action.default, flag.names
        else:
            assert flag.line in (action.help or "")
        return
    if flag.verdict == Verdict.ONLY:  # the one value shoal does is accepted
        args = parser.parse_args(["/models/llama", flag.names[0], str(flag.value)])
        assert getattr(args, _action(parser, flag.names[0]).dest) == flag.value
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert flag.line in err and flag.example[0] in err, err
