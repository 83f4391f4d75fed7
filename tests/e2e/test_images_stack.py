"""Images in chat through the real stack (router, one prefill and one decode instance) serving a tiny Gemma 3, a
tiny Mistral 3 and a tiny Qwen2.5-VL image-text model, with the openai client: the answer is transformers' greedy answer to the same pixels; the
prefill encodes the image and hands the KV (and the request, its image with it) to the decode; another image
behind the same words is another answer; an instance stopped with the request on it costs a retry elsewhere,
not the request."""

from __future__ import annotations

import base64
import io
import os
import signal
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.e2e.stack import prefill_decode_stack
from tests.engine.tiny_models import (
    QWEN_VL_TOKENS,
    expand_image_tokens,
    expand_qwen_vl_tokens,
    gemma3_image_checkpoint,
    hf_model,
    image_pixels,
    image_text_checkpoint,
    qwen_vl_checkpoint,
    qwen_vl_pixels,
)
from tests.router.router_harness import wait_until

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 6


@pytest.fixture(scope="module", params=["gemma3", "mistral3", "qwen2_5_vl"])
def folder(request, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    build = {"gemma3": gemma3_image_checkpoint, "mistral3": image_text_checkpoint,
             "qwen2_5_vl": qwen_vl_checkpoint}[request.param]
    return build(tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def stack(redis_url, folder):  # type: ignore[no-untyped-def]
    float32 = ["--dtype", "float32"]
    with prefill_decode_stack(redis_url, str(folder), prefill_args=float32, decode_args=float32,
                              router_args=["--engine-stall-timeout", "3"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _image(seed: int, height: int, width: int):  # type: ignore[no-untyped-def]
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def _data_url(image) -> str:  # type: ignore[no-untyped-def]
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _messages(image) -> list[dict]:  # type: ignore[no-untyped-def,type-arg]
    return [{"role": "user", "content": [
        {"type": "text", "text": "w5 w9 w30"},
        {"type": "image_url", "image_url": {"url": _data_url(image)}},
        {"type": "text", "text": "w11 w12"},
    ]}]


def _expected(folder: Path, image) -> list[str]:  # type: ignore[no-untyped-def]
    """transformers' greedy answer: the template's text with the image's tokens expanded, its pixels."""
    from transformers import AutoProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    text = tokenizer.apply_chat_template(_messages(image), tokenize=False, add_generation_prompt=True)
    rendered = tokenizer(text, add_special_tokens=False).input_ids
    if folder.name.startswith("gemma3"):  # Gemma 3's processor, over the text; its image tokens marked for its mask
        processed = AutoProcessor.from_pretrained(str(folder))(text=text, images=[image], add_special_tokens=False,
                                                               return_tensors="pt")
        ids = processed["input_ids"][0].tolist()
        kwargs = {"pixel_values": processed["pixel_values"], "token_type_ids": processed["token_type_ids"]}
    elif (folder / "processor_config.json").is_file():  # Mistral 3's Pixtral processor
        pixels, height, width = image_pixels(folder, image)
        ids, _ = expand_image_tokens(rendered, [(height, width)])
        kwargs = {"pixel_values": pixels[None], "image_sizes": torch.tensor([[height, width]])}
    else:  # Qwen2.5-VL's patches, and the image tokens marked for its M-RoPE, as its processor hands them over
        patches, grid = qwen_vl_pixels(folder, image)
        ids, _ = expand_qwen_vl_tokens(rendered, [grid])
        kwargs = {"pixel_values": patches, "image_grid_thw": torch.tensor([grid]),
                  "mm_token_type_ids": torch.tensor([[int(t == QWEN_VL_TOKENS["<|image_pad|>"]) for t in ids]])}
    with torch.inference_mode():
        out = hf_model(folder).generate(torch.tensor([ids]), **kwargs, max_new_tokens=MAX_TOKENS,
                                        do_sample=False, pad_token_id=0, eos_token_id=None)
    return str(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)).split()


def _ask(client, image) -> list[str]:  # type: ignore[no-untyped-def]
    answer = client.chat.completions.create(model=client.models.list().data[0].id, messages=_messages(image),
                                            temperature=0, max_tokens=MAX_TOKENS,
                                            extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length"
    return str(answer.choices[0].message.content).split()  # the tiny tokenizer's words


def test_an_image_in_chat_answers_as_transformers_through_prefill_and_decode(stack, client, folder) -> None:  # type: ignore[no-untyped-def]
    from PIL import Image

    # Prompts of more than a block: prefill -> decode. The other image is a white one: two images of random noise
    # come out of Gemma's resizing and pooling too alike for its tiny model's greedy answer to tell apart.
    first, second = _image(1, 100, 180), Image.new("RGB", (180, 100), (255, 255, 255))
    key = "pdserve:request_prefill_time_seconds_count"
    before = stack.metrics("prefill-a").get(key, 0.0)
    expected = _expected(folder, first)
    assert _ask(client, first) == expected
    # The prefill ran the prompt, its image with it (its counters are published twice a second: they may trail).
    assert wait_until(lambda: stack.metrics("prefill-a")[key] >= before + 1, 30, 0.1)
    assert stack.metrics("prefill-a")[key] == before + 1
    other = _expected(folder, second)
    assert other != expected  # the pixels decide the answer
    assert _ask(client, second) == other
    assert _ask(client, first) == expected  # again, from the prefix cache


@pytest.mark.parametrize("folder", ["mistral3"], indirect=True)  # the router's path is the same for both
def test_an_image_request_on_a_stopped_prefill_is_answered_elsewhere(stack, client, folder) -> None:  # type: ignore[no-untyped-def]
    """SIGSTOP the prefill: the router takes it for dead after 3 s and runs the request, its image with it, on
    the decode."""
    image = _image(3, 120, 90)
    expected = _expected(folder, image)
    pid = stack.procs["prefill-a"].popen.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        assert _ask(client, image) == expected
    finally:
        os.kill(pid, signal.SIGCONT)
    router = httpx.get(stack.url + "/metrics", timeout=5).text
    assert any(line.startswith("pdserve:request_migrations_total") and not line.endswith(" 0.0")
               for line in router.splitlines()), "the request was not continued elsewhere"
    stack.wait_ready(1, 1)
