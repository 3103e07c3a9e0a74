"""The official OpenAI SDK against `strata serve` on a fixture model."""
import asyncio
import json

import openai
import pytest

from conftest import FIXTURE

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = [{"role": "user", "content": "Hello! How are you today?"}]


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def chat_text(c, **kw):
    args = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, extra_body=NO_THINKING)
    args.update(kw)
    return c.chat.completions.create(**args)


def stream_text(c, **kw):
    args = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, extra_body=NO_THINKING, stream=True)
    args.update(kw)
    parts, finish = [], None
    for chunk in c.chat.completions.create(**args):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


def test_streaming_equals_non_streaming_and_usage(server):
    c = client(server)
    full = chat_text(c)
    text, finish = stream_text(c)
    assert full.choices[0].message.content == text != ""
    assert full.choices[0].finish_reason == finish == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    assert full.model == "tiny"


def test_stop_string_spanning_tokens_never_leaks(server):
    c = client(server)
    text = chat_text(c).choices[0].message.content
    stop = text[2:8]
    want = text[: text.index(stop)]
    r = chat_text(c, stop=[stop])
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop"
    streamed, finish = stream_text(c, stop=stop)
    assert streamed == want and finish == "stop"


def test_thinking_goes_to_reasoning_content(server):
    r = client(server).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    msg = r.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None)
    assert reasoning, msg
    assert "<think>" not in (msg.content or "") and "</think>" not in reasoning


def test_completions_with_token_ids(server, reference):
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    prompt = [int(t) for t in load_file(str(FIXTURE / "reference.safetensors"))["tokens"]]
    c = client(server)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, logprobs=1)
    assert r.choices[0].text == tok.decode(reference["greedy_tokens"], skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(prompt)
    assert len(r.choices[0].logprobs.token_logprobs) == 24
    echoed = c.completions.create(model="tiny", prompt=prompt[:5], max_tokens=2, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(tok.decode(prompt[:5], skip_special_tokens=False))


def test_tool_round_trip_renders_like_transformers(server, reference):
    chat = reference["chats"][2]
    messages = []
    for m in chat["messages"]:
        m = dict(m)
        if "tool_calls" in m:
            # The SDK sends arguments as a JSON string; the server hands the template an object.
            m["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                "function": {"name": t["function"]["name"], "arguments": json.dumps(t["function"]["arguments"])}}
                               for i, t in enumerate(m["tool_calls"])]
        if m["role"] == "tool":
            m["tool_call_id"] = "call_0"
        messages.append(m)
    r = client(server).chat.completions.create(model="tiny", messages=messages, tools=chat["tools"], max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(chat["ids"])
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_bad_input_is_a_400(server):
    c = client(server)
    cases = [dict(max_tokens=0), dict(temperature=-1), dict(top_p=1.5), dict(messages=[]),
             dict(messages=[{"role": "wizard", "content": "x"}]), dict(n=2), dict(max_tokens=10**9)]
    for case in cases:
        with pytest.raises(openai.BadRequestError) as e:
            chat_text(c, **case)
        assert e.value.status_code == 400, case
        assert e.value.body["message"], case


def test_api_key(keyed_server):
    with pytest.raises(openai.AuthenticationError):
        client(keyed_server, key="wrong").models.list()
    assert client(keyed_server, key="sekrit").models.list().data[0].id


def test_32_concurrent_streams_match_single_client(server):
    want = chat_text(client(server)).choices[0].message.content

    async def one(c):
        parts = []
        stream = await c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                                 extra_body=NO_THINKING, stream=True)
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
        return "".join(parts)

    async def all_of_them():
        c = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(one(c) for _ in range(32)))

    assert asyncio.run(all_of_them()) == [want] * 32


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


def test_model_tool_call_round_trip(server, reference):
    # The fixture tokenizer has one token spelling a whole Qwen3.5 tool call; biasing the sampler
    # to it makes the model emit a real call that the server must parse.
    c = client(server)
    force = {"logit_bias": {str(reference["tool_call_token"]): 100}, "max_tokens": 1}
    r = chat_text(c, tools=[WEATHER_TOOL], **force)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert not r.choices[0].message.content
    streamed = [ch for ch in c.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL], temperature=0,
                                                       extra_body=NO_THINKING, stream=True, **force)]
    deltas = [tc for ch in streamed if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris", "days": 2}
    assert [ch.choices[0].finish_reason for ch in streamed if ch.choices][-1] == "tool_calls"
    # Send the result back: the conversation renders and the model answers.
    follow = MESSAGES + [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = c.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER_TOOL], max_tokens=3, temperature=0)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
