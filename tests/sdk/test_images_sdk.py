"""Images through the official OpenAI and Anthropic SDKs against `strata serve` on the vision
fixture: a base64 image gets the tokens `strata generate --image` gives, and so does its URL
where the server fetches URLs; every bad image is a 400 naming its content part; the same text with another image gives another output without
reusing state past the image; 8 concurrent requests mixing images and text give their solo
outputs."""
import base64
import functools
import http.server
import json
import struct
import subprocess
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest

from conftest import BINARY, ROOT, start

VISION = ROOT / "fixtures" / "vision" / "qwen3_5-vl-tiny-g"
TEXT = "What differs?"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}


@pytest.fixture(scope="module")
def vision_server():
    proc, url = start("--max-images-per-request", "2", "--max-image-pixels", "10000", fixture=VISION)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def b64(data):
    return base64.b64encode(data).decode()


def image(name):
    return (VISION / name).read_bytes()


def png(width, height, rows=None):
    """A PNG of `width`×`height` (grey); with `rows` False, a few bytes of pixel data under a
    header that claims that size (a decompression bomb's shape)."""
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
    raw = b"\x00" * 16 if rows is False else b"".join(b"\x00" + bytes([128]) * width for _ in range(height))
    return header + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def openai_part(data, media_type="image/png"):
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{b64(data)}"}}


def openai_chat(url, images, text=TEXT, max_tokens=8):
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    content = [openai_part(i) for i in images] + [{"type": "text", "text": text}]
    return c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                     max_tokens=max_tokens, temperature=0, extra_body=NO_THINKING)


def cli(*names):
    images = [arg for n in names for arg in ("--image", str(VISION / n))]
    out = subprocess.run([str(BINARY), "generate", "--model", str(VISION), "--chat", TEXT, *images, "--no-thinking",
                          "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_openai_sdk_image_gets_the_cli_tokens(vision_server):
    want = cli("image-a.png", "image-b.png")
    r = openai_chat(vision_server, [image("image-a.png"), image("image-b.png")])
    assert r.choices[0].message.content == want["text"]
    assert r.usage.prompt_tokens == want["prompt_tokens"]
    assert r.usage.completion_tokens == 8


def test_anthropic_sdk_image_gets_the_cli_tokens(vision_server):
    want = cli("image-b.png")
    c = anthropic.Anthropic(base_url=vision_server, api_key="none", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(image("image-b.png"))}}
    r = c.messages.create(model="tiny", max_tokens=8, extra_body={"temperature": 0, "ignore_eos": True},
                          messages=[{"role": "user", "content": [block, {"type": "text", "text": TEXT}]}])
    assert "".join(b.text for b in r.content if b.type == "text") == want["text"]
    assert r.usage.input_tokens == want["prompt_tokens"]


def test_another_image_gives_another_output_and_no_reuse_past_it(vision_server):
    first = openai_chat(vision_server, [image("image-a.png")])
    other = openai_chat(vision_server, [png(32, 24)])
    assert other.choices[0].message.content != first.choices[0].message.content
    # The prompt up to the first image token is the chat markup before it: a few tokens.
    assert other.usage.prompt_tokens_details.cached_tokens <= 4
    again = openai_chat(vision_server, [image("image-a.png")])
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 12


BAD = [
    ("truncated", lambda: openai_part(image("image-a.png")[:60])),
    ("declared jpeg, is png", lambda: openai_part(image("image-a.png"), "image/jpeg")),
    ("unknown media type", lambda: openai_part(image("image-a.png"), "image/bmp")),
    ("not an image", lambda: openai_part(b"hello, world", "image/png")),
    ("zero-sized", lambda: openai_part(png(0, 0))),
    ("decompression bomb", lambda: openai_part(png(50_000, 50_000, rows=False))),
    ("more pixels than allowed", lambda: openai_part(png(120, 100))),
    ("not base64", lambda: {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}),
    ("a URL, not fetched here", lambda: {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}),
]


@pytest.mark.parametrize("case,part", BAD, ids=[b[0] for b in BAD])
def test_bad_images_are_a_400_naming_the_part(vision_server, case, part):
    c = openai.OpenAI(base_url=vision_server + "/v1", api_key="none", max_retries=0)
    content = [{"type": "text", "text": TEXT}, part()]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=2)
    assert e.value.body["param"] == "messages[0].content[1]", (case, e.value.body)
    if case == "decompression bomb":
        assert "50000x50000 pixels, more than the 10000 allowed" in e.value.body["message"]


def test_too_many_images_and_bad_anthropic_blocks_are_a_400(vision_server):
    with pytest.raises(openai.BadRequestError) as e:
        openai_chat(vision_server, [image("image-a.png")] * 3)
    assert e.value.body["param"] == "messages[0].content[2]"
    c = anthropic.Anthropic(base_url=vision_server, api_key="none", max_retries=0)
    for source in ({"type": "base64", "media_type": "image/tiff", "data": b64(image("image-a.png"))},
                   {"type": "base64", "media_type": "image/png", "data": b64(image("image-a.png")[:60])},
                   {"type": "url", "url": "https://example.com/a.png"}):
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="tiny", max_tokens=2,
                              messages=[{"role": "user", "content": [{"type": "image", "source": source}]}])
        assert "messages[0].content[0]" in e.value.body["error"]["message"]


def test_concurrent_requests_mixing_images_and_text_give_their_solo_outputs(vision_server):
    a, b = image("image-a.png"), image("image-b.png")
    requests = [([a], TEXT), ([b], TEXT), ([a, b], TEXT), ([b, a], "Which is larger?"),
                ([], TEXT), ([], "Describe a picture."), ([png(32, 24)], TEXT), ([], "Hello there")]
    run = lambda r: openai_chat(vision_server, r[0], r[1], max_tokens=10).choices[0].message.content
    solo = [run(r) for r in requests]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, requests))
    assert together == solo


@pytest.fixture(scope="module")
def image_site():
    """The fixture's folder over HTTP on a local port."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(VISION))
    handler.log_message = lambda *args: None
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{site.server_address[1]}"
    site.shutdown()


def test_image_urls_are_fetched_with_allow_image_urls(image_site):
    proc, url = start("--allow-image-urls", fixture=VISION)
    try:
        want = cli("image-a.png", "image-b.png")
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        content = [{"type": "image_url", "image_url": {"url": f"{image_site}/image-a.png"}},
                   {"type": "image_url", "image_url": {"url": f"{image_site}/image-b.png"}},
                   {"type": "text", "text": TEXT}]
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                      max_tokens=8, temperature=0, extra_body=NO_THINKING)
        assert r.choices[0].message.content == want["text"]
        a = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        blocks = [{"type": "image", "source": {"type": "url", "url": f"{image_site}/image-{n}.png"}} for n in "ab"]
        r = a.messages.create(model="tiny", max_tokens=8, extra_body={"temperature": 0, "ignore_eos": True},
                              messages=[{"role": "user", "content": blocks + [{"type": "text", "text": TEXT}]}])
        assert "".join(b.text for b in r.content if b.type == "text") == want["text"]
        # A missing file and a file that is not an image: 400s naming the part.
        for name in ("missing.png", "config.json"):
            content = [{"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": f"{image_site}/{name}"}}]
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=2)
            assert e.value.body["param"] == "messages[0].content[1]", e.value.body
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_images_to_a_model_without_a_vision_tower_are_a_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        openai_chat(server, [image("image-a.png")])
    assert e.value.body["param"] == "messages[0].content[0]"
    assert "no vision tower" in e.value.body["message"]
