"""The tool-call parsers: calls found in a model's own text, content kept, malformed left be."""

from __future__ import annotations

import json

from shoal.deploy.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser


def test_hermes_finds_every_tagged_call_and_keeps_the_rest_as_content() -> None:
    text = (
        'Checking.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>'
    )
    content, calls = HermesToolParser().parse(text)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {"y": [2]}),
    ]
    # An unclosed tag at the end (stopped on </tool_call> as a stop string) still counts.
    _, calls = HermesToolParser().parse('<tool_call>{"name": "a", "arguments": {}}')
    assert [c.name for c in calls] == ["a"]


def test_hermes_leaves_text_without_calls_or_with_a_malformed_one() -> None:
    assert HermesToolParser().parse("no calls here") == ("no calls here", [])
    broken = '<tool_call>{"name": "a", "arguments": </tool_call>'
    assert HermesToolParser().parse(broken) == (broken, [])
    assert HermesToolParser().parse('<tool_call>{"arguments": {}}</tool_call>')[1] == []


def test_hermes_holds_back_a_tag_cut_between_deltas() -> None:
    parser = HermesToolParser()
    assert parser.hold_from("plain text") is None
    assert parser.hold_from("text <tool") == 5
    assert parser.hold_from("text <tool_call>{") == 5


def test_llama3_json_reads_one_or_several_calls_and_nothing_else() -> None:
    parser = Llama3JsonToolParser()
    content, calls = parser.parse('{"name": "a", "parameters": {"q": "x"}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"q": "x"})
    ]
    text = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": 1}}'
    assert [c.name for c in parser.parse(text)[1]] == ["a", "b"]
    for text in ("Hello!", '{"name": "a", "parameters": {}} and more', '{"q": 1}', "{broken"):
        assert parser.parse(text) == (text, [])
    assert parser.hold_from("  ") == 0 and parser.hold_from(' {"na') == 0
    assert parser.hold_from("Sure, ") is None
