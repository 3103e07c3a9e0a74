"""Structured output through the official SDKs, on a random-weight fixture whose free output is
noise: every constrained output is validated by the `jsonschema` package, Python's `re` or the
tools' schemas, never by the grammar that produced it. The server drafts with prompt lookup, and
each batch of 16 concurrent requests mixes constrained rows with free ones; the second pass of
each batch starts from the prompt cache."""
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, List, Literal

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import start

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def drafting_server():
    proc, url = start("--draft", "ngram", "--num-draft-tokens", "3", "--max-num-seqs", "16")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


class Home(BaseModel):
    zip: int = Field(ge=0, le=99999)
    ok: bool


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "owl"]
    tags: List[Annotated[str, Field(max_length=4)]] = Field(max_length=3)
    home: Home


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 99999}, "ok": {"type": "boolean"}},
            "required": ["zip", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "home"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
# Sums of small numbers with parentheses; `check_lark` reads them independently.
LARK = 'start: sum\nsum: term ("+" term)*\nterm: NUMBER | "(" sum ")"\nNUMBER: /[0-9]{1,3}/'


def check_lark(text):
    while True:
        reduced = re.sub(r"\(([0-9]{1,3}(\+[0-9]{1,3})*)\)", "0", text)
        if reduced == text:
            return re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", text) is not None
        text = reduced


def run(url, kind, seed):
    """One request of `kind` (a structure, or "free"); returns the constrained text or None."""
    c = client(url)
    # A few prompts, each sent by many requests: later ones start from the prompt cache.
    messages = [{"role": "user", "content": f"Describe pet number {seed % 5} as asked."}]
    extra = dict(NO_THINKING)
    if kind == "schema":
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    elif kind == "regex":
        extra["structured_outputs"] = {"regex": REGEX}
    elif kind == "lark":
        extra["structured_outputs"] = {"grammar": LARK}
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=160, temperature=1.0, seed=seed,
                                  extra_body=extra)
    if kind == "free":
        return None
    assert r.choices[0].finish_reason == "stop", (kind, seed, r)
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("kind", ["schema", "regex", "lark"])
def test_hundred_seeded_outputs_are_valid_in_mixed_speculative_batches(drafting_server, kind):
    # 100 constrained requests, a free one after every third, 16 at a time.
    jobs = [job for seed in range(100) for job in [(kind, seed)] + [("free", seed)] * (seed % 3 == 0)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda j: run(drafting_server, *j), jobs))
    outputs = [r for r in results if r is not None]
    assert len(outputs) == 100
    for text, _ in outputs:
        if kind == "schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert check_lark(text), text
    assert any(cached > 0 for _, cached in outputs), "some requests started from the prompt cache"


def test_openai_parse_with_a_pydantic_model(server):
    c = client(server)
    parse = c.chat.completions.parse if hasattr(c.chat.completions, "parse") else c.beta.chat.completions.parse
    for seed in range(5):
        r = parse(model="tiny", messages=[{"role": "user", "content": "A pet, please."}], response_format=Pet,
                  max_tokens=160, temperature=1.0, seed=seed, extra_body=NO_THINKING)
        pet = r.choices[0].message.parsed
        assert isinstance(pet, Pet), r
        assert pet.kind in ("cat", "dog", "owl") and len(pet.name) <= 8


WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"],
    },
}


def test_openai_forced_tool_call(server):
    c = client(server)
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "parameters": WEATHER["input_schema"]}}]
    for seed in range(5):
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                      max_tokens=120, temperature=1.0, seed=seed, extra_body=NO_THINKING)
        assert r.choices[0].finish_reason == "tool_calls", r
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["input_schema"])


def test_anthropic_tool_choice_names_a_tool(server):
    c = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0)
    for seed in range(5):
        r = c.messages.create(model="tiny", max_tokens=120, messages=[{"role": "user", "content": "Weather?"}],
                              tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                              extra_body={"seed": seed, "temperature": 1.0})
        assert r.stop_reason == "tool_use", r
        uses = [b for b in r.content if b.type == "tool_use"]
        assert uses and all(u.name == "get_weather" for u in uses)
        for u in uses:
            jsonschema.validate(u.input, WEATHER["input_schema"])


def test_unusable_schema_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                               extra_body={"structured_outputs": {"regex": "[a-"}})
    assert "structured_outputs" in str(e.value)
