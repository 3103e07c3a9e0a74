"""The official OpenAI SDK's Responses API against `strata serve` on a fixture model."""
import json

import openai
import pytest

from conftest import FIXTURE, start

HELLO = "Hello! How are you today?"
# Greedy, thinking off, 12 tokens: the tiny model's answers never end before that.
ASK = dict(model="tiny", max_output_tokens=12, temperature=0, reasoning={"effort": "none"})
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
# What the chat template adds after the conversation with thinking off: the prompt less it is
# what the next turn's prompt starts with.
GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def server():
    """A server of these tests' own: they fill a prompt cache that other files' tests expect cold."""
    proc, url = start()
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def said(response):
    """Each output item's type and text or call, ids aside."""
    out = []
    for item in response.output:
        if item.type == "function_call":
            out.append((item.type, item.name, json.loads(item.arguments)))
        else:
            out.append((item.type, "".join(part.text for part in item.content)))
    return out


def test_create_and_stream_give_the_same_text(server):
    c = client(server)
    r = c.responses.create(input=HELLO, **ASK)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.usage.input_tokens_details.cached_tokens >= 0
    deltas, last = [], None
    with c.responses.stream(input=HELLO, **ASK) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
                assert event.snapshot == "".join(deltas)
            last = event
    assert "".join(deltas) == r.output_text
    assert last.type == "response.incomplete" and last.response.output_text == r.output_text
    # stream=True on create: the raw events, numbered in order.
    events = list(c.responses.create(input=HELLO, stream=True, **ASK))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text


def test_thinking_is_a_reasoning_item(server):
    r = client(server).responses.create(input=HELLO, model="tiny", max_output_tokens=8, temperature=0,
                                        reasoning={"effort": "high"})
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text
    assert "<think>" not in r.output[0].content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens > 0


def test_retrieve_and_delete(server):
    c = client(server)
    r = c.responses.create(input=HELLO, metadata={"run": "7"}, **ASK)
    got = c.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"run": "7"}
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(input="Hi", previous_response_id=r.id, **ASK)
    assert e.value.body["param"] == "previous_response_id"
    kept_not = c.responses.create(input=HELLO, store=False, **ASK)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(kept_not.id)


def test_function_tool_round_trip(server, reference):
    # The fixture tokenizer has one token spelling a whole tool call: biased to it, the model calls.
    c = client(server)
    force = dict(ASK, tools=[WEATHER_TOOL], max_output_tokens=1,
                 extra_body={"logit_bias": {str(reference["tool_call_token"]): 100}})
    r = c.responses.create(input="What is the weather?", **force)
    assert r.status == "completed"
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    with c.responses.stream(input="What is the weather?", **force) as stream:
        arguments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert json.loads(arguments) == {"city": "Paris", "days": 2}
    assert said(final) == said(r)
    # The result, by previous_response_id and sent whole, gets the same answer.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    answered = c.responses.create(previous_response_id=r.id, input=[result], tools=[WEATHER_TOOL], **ASK)
    assert answered.output_text
    assert answered.usage.input_tokens > r.usage.input_tokens
    whole = [{"role": "user", "content": "What is the weather?"}] + [i.model_dump(exclude_none=True) for i in r.output]
    sent = c.responses.create(input=whole + [result], tools=[WEATHER_TOOL], store=False, **ASK)
    assert said(sent) == said(answered)


def test_three_turns_by_previous_response_id_reuse_the_cache(server):
    from tokenizers import Tokenizer
    generation_prompt = len(Tokenizer.from_file(str(FIXTURE / "tokenizer.json")).encode(
        GENERATION_PROMPT, add_special_tokens=False).ids)
    c = client(server)
    turns = ["Tell me about Paris.", "And London?", "Which is bigger?"]
    previous = c.responses.create(input=turns[0], instructions="Answer briefly.", **ASK)
    conversation = [{"role": "user", "content": turns[0]}]
    for turn in turns[1:]:
        r = c.responses.create(input=turn, previous_response_id=previous.id, instructions="Answer briefly.", **ASK)
        assert r.previous_response_id == previous.id
        assert r.usage.input_tokens_details.cached_tokens >= previous.usage.input_tokens - generation_prompt
        conversation += [item.model_dump(exclude_none=True) for item in previous.output]
        conversation.append({"role": "user", "content": turn})
        whole = c.responses.create(input=conversation, instructions="Answer briefly.", store=False, **ASK)
        assert said(whole) == said(r)
        assert whole.usage.input_tokens == r.usage.input_tokens
        previous = r


def test_bad_input_is_a_4xx(server):
    c = client(server)
    cases = [dict(input=[{"type": "web_search_call", "id": "x"}]), dict(input=[]), dict(input="x", max_output_tokens=0),
             dict(input="x", tools=[{"type": "web_search"}]), dict(input="x", tool_choice="required"),
             dict(input="x", reasoning={"effort": "max"}), dict(input="x", metadata={"k": "v" * 600}),
             dict(input="x", max_output_tokens=10**9)]
    for case in cases:
        args = dict(ASK, **case)
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(**args)
        assert e.value.status_code == 400, case
        assert e.value.body["message"] and e.value.body["type"] == "invalid_request_error", case


def test_api_key(keyed_server):
    with pytest.raises(openai.AuthenticationError):
        client(keyed_server).responses.create(input="x", **ASK)


def test_stored_responses_survive_a_restart_with_ssd_cache(tmp_path):
    proc, url = start("--ssd-cache", str(tmp_path))
    try:
        c = client(url)
        first = c.responses.create(input=HELLO, **ASK)
        second = c.responses.create(input="Tell me more.", previous_response_id=first.id, **ASK)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert (tmp_path / "responses" / f"{first.id}.json").is_file()
    proc, url = start("--ssd-cache", str(tmp_path))
    try:
        c = client(url)
        assert c.responses.retrieve(first.id).output_text == first.output_text
        again = c.responses.create(input="Tell me more.", previous_response_id=first.id, **ASK)
        assert again.output_text == second.output_text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
