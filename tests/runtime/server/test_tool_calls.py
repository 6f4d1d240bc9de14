"""Tool calling through the official `openai` client, on a tiny random Qwen2 checkpoint whose chat template
renders tools (Qwen2.5 / Hermes format): forced calls always parse and validate, a call -> tool result ->
answer round trip works streamed and not, and the parsers split streamed output exactly as whole output."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from tokenfleet.runtime.engine.async_engine import AsyncEngine
from tokenfleet.runtime.openai.tool_parsers import HermesToolParser, JsonToolParser, ParsedCall
from tokenfleet.runtime.openai.tool_stream import ToolCallStream

from .conftest import ServerThread, real_config
from .tool_checkpoint import build_tool_checkpoint


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Tokyo"]
    days: int = Field(ge=1, le=7)


class TimeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tz: Literal["UTC", "CET"]


ARGS = {"get_weather": WeatherArgs, "get_time": TimeArgs}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["tz"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_checkpoint(tmp_path_factory):
    return build_tool_checkpoint(tmp_path_factory.mktemp("qwen-tools"))


@pytest.fixture(scope="module")
def tool_server(tool_checkpoint):
    server = ServerThread(real_config(model={"model": str(tool_checkpoint)}), AsyncEngine.from_config).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oai(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _model(oai) -> str:
    return oai.models.list().data[0].id


def _validate(call) -> None:
    ARGS[call.function.name].model_validate_json(call.function.arguments)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_yields_valid_calls(oai, parallel):
    resp = oai.chat.completions.create(
        model=_model(oai), messages=ASK, tools=TOOLS, tool_choice="required",
        n=6, seed=11, temperature=1.0, max_tokens=160, parallel_tool_calls=parallel,
    )  # fmt: skip
    for choice in resp.choices:
        calls = choice.message.tool_calls
        assert calls, choice.message
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            _validate(call)
        if not parallel:  # one call, then the grammar allows only the end of the turn
            assert len(calls) == 1 and choice.finish_reason == "tool_calls"
        else:  # a random model may keep calling until max_tokens; every completed call still validates
            assert choice.finish_reason in ("tool_calls", "length")


def test_named_choice_and_no_parallel_calls_give_exactly_that_one_call(oai):
    resp = oai.chat.completions.create(
        model=_model(oai), messages=ASK, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        n=3, seed=5, temperature=1.0, max_tokens=120, parallel_tool_calls=False,
    )  # fmt: skip
    for choice in resp.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        _validate(call)


def _streamed(oai, **kwargs):
    content, calls, finish = "", {}, None
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_tool_call_round_trip_streamed_and_not(oai, tool_server, tool_checkpoint):
    model = _model(oai)
    kwargs = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
              "max_tokens": 200, "parallel_tool_calls": False}  # fmt: skip
    first = oai.chat.completions.create(**kwargs)
    calls = first.choices[0].message.tool_calls
    content, streamed, finish = _streamed(oai, **kwargs)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]
    # Deltas of several tokens (server.stream_interval) cut the call's text elsewhere: the same call.
    config = real_config(model={"model": str(tool_checkpoint)}, server={"stream_interval": 5})
    chunky = ServerThread(config, AsyncEngine.from_config).start()
    try:
        client = openai.OpenAI(base_url=chunky.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        chunky_content, chunky_calls, chunky_finish = _streamed(client, **kwargs)
        assert (chunky_content, chunky_finish) == (content, finish)
        assert [(c["name"], c["arguments"]) for c in chunky_calls] == [
            (c["name"], c["arguments"]) for c in streamed
        ]
    finally:
        chunky.stop()
    # The assistant's calls and one result per call go back through the template.
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls),
    ]
    answer = oai.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=6
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")
    tok = tool_server.engine.tokenizer
    rendered = tok.apply_chat_template(
        [
            *ASK,
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for c in calls
            ]},
            *({"role": "tool", "content": "sunny, 21 C", "tool_call_id": c.id} for c in calls),
        ],
        tools=TOOLS,
    )  # fmt: skip
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert answer.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    streamed_answer, streamed_calls, _ = _streamed(
        oai, model=model, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=6
    )
    assert streamed_answer == answer.choices[0].message.content and streamed_calls == []


def test_tool_choice_without_tools_and_unknown_function_are_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=_model(oai), messages=ASK, tool_choice="required", max_tokens=4)
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=_model(oai), messages=ASK, tools=TOOLS, max_tokens=4,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )  # fmt: skip
    assert e.value.body["param"] == "tool_choice"


# --- parsers: whole output and streamed output agree --------------------------------------------------


def _stream_split(parser, text: str, step: int) -> tuple[str, list[ParsedCall]]:
    splitter = ToolCallStream(parser)
    content, calls = "", []
    for i in range(0, len(text), step):
        c, new = splitter.feed(text[i : i + step])
        content, calls = content + c, calls + new
    c, new = splitter.finish()
    return content + c, calls + new


HERMES_OUT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
)


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_stream_split_equals_whole_parse(step):
    parser = HermesToolParser()
    whole = parser.parse(HERMES_OUT)
    assert whole.content == "Let me check."
    assert [c.name for c in whole.calls] == ["get_weather", "get_time"]
    content, calls = _stream_split(parser, HERMES_OUT, step)
    assert content.strip() == whole.content and calls == list(whole.calls)


def test_hermes_text_that_only_looks_like_a_marker_stays_text():
    parser = HermesToolParser()
    text = "a < b and <tool_call> is not json </tool_call>"
    assert parser.parse(text).calls == ()
    assert _stream_split(parser, text, 2) == (text, [])
    unclosed = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}'
    assert parser.parse(unclosed).calls == (ParsedCall("get_time", '{"tz": "CET"}'),)


def test_json_parser_reads_objects_lists_and_parameters():
    parser = JsonToolParser()
    one = parser.parse('{"name": "get_time", "parameters": {"tz": "UTC"}}')
    assert one.content is None and one.calls == (ParsedCall("get_time", '{"tz": "UTC"}'),)
    many = parser.parse('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]')
    assert [c.name for c in many.calls] == ["a", "b"]
    assert parser.parse("plain answer {not json}").calls == ()
    assert _stream_split(parser, '  {"name": "a", "arguments": {}}', 4)[1] == [ParsedCall("a", "{}")]
    assert _stream_split(parser, "hello", 2) == ("hello", [])
