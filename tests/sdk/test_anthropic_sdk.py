"""The official Anthropic SDK against `strata serve` on a fixture model."""
import anthropic
import pytest


def client(url):
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)


def test_messages_streaming_equals_non_streaming(server):
    c = client(server)
    args = dict(model="tiny", max_tokens=10, extra_body={"temperature": 0}, system="Be brief.",
                messages=[{"role": "user", "content": "Hello!"}])
    full = c.messages.create(**args)
    assert full.stop_reason == "max_tokens"
    assert full.usage.output_tokens == 10
    text = "".join(b.text for b in full.content if b.type == "text")
    with c.messages.stream(**args) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text != ""
    assert final.stop_reason == "max_tokens"


def test_stop_sequences(server):
    c = client(server)
    args = dict(model="tiny", max_tokens=10, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Hello!"}])
    text = c.messages.create(**args).content[0].text
    stop = text[1:6]
    r = c.messages.create(**args, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop)]


def test_tool_result_round_trip(server):
    r = client(server).messages.create(
        model="tiny", max_tokens=4, extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "description": "Get the weather",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}])
    assert r.usage.input_tokens > 50


def test_bad_input_is_a_400(server):
    c = client(server)
    for bad in ([], [{"role": "system", "content": "x"}]):
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="tiny", max_tokens=5, messages=bad)
        assert e.value.body["error"]["type"] == "invalid_request_error"


def test_model_tool_use(server, reference):
    c = client(server)
    tools = [{"name": "get_weather", "description": "Get the weather",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]
    args = dict(model="tiny", max_tokens=1, tools=tools, messages=[{"role": "user", "content": "Weather in Paris?"}],
                extra_body={"temperature": 0, "logit_bias": {str(reference["tool_call_token"]): 100}})
    r = c.messages.create(**args)
    assert r.stop_reason == "tool_use"
    block = [b for b in r.content if b.type == "tool_use"][0]
    assert (block.name, block.input) == ("get_weather", {"city": "Paris", "days": 2})
    with c.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Paris", "days": 2}]
    assert final.stop_reason == "tool_use"
