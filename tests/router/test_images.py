"""Image inputs of chat completions (vLLM's): a user message's ``image_url`` parts reach the engines as the model
folder's processor makes them (pixels, digest, the prompt's image tokens expanded as Pixtral's processor
expands them), through the openai client, a migration and prefix routing; and each refusal names its field.
Qwen2.5-VL's the same way: its processor's patches, each ``<|image_pad|>`` expanded to its image's run; Gemma 3's
as its processor expands the text, newlines merged."""

from __future__ import annotations

import argparse
import base64
import http.server
import io
import json
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from common.kvcache.hashing import compute_block_hashes
from common.protocol import GenerateRequest, image_digest
from common.registry import PrefixIndex
from router.app import create_app
from router.config import RequestLimits
from router.image_fetch import ImageFetcher
from router.images import (
    IMAGE_FAMILIES,
    ImageRef,
    ModelImages,
    QwenVLImages,
    limit_mm_per_prompt_arg,
    mm_processor_cache_gb_arg,
)
from router.main import build_parser
from router.tokenization import PromptProcessor
from tests.engine.tiny_models import (
    GEMMA3_TOKENS,
    IDEFICS3_TILE_TOKENS,
    IDEFICS3_TOKENS,
    IMAGE_TOKENS,
    INTERNVL_TILE,
    INTERNVL_TILE_TOKENS,
    INTERNVL_TOKENS,
    LLAVA_TOKENS,
    QWEN_VL_PATCH,
    QWEN_VL_TOKENS,
    expand_image_tokens,
    expand_qwen_vl_tokens,
    gemma3_image_checkpoint,
    idefics3_checkpoint,
    image_pixels,
    image_text_checkpoint,
    internvl_checkpoint,
    internvl_pixels,
    llava_checkpoint,
    llava_next_checkpoint,
    llava_next_pixels,
    llava_onevision_checkpoint,
    llava_onevision_sample_pixels,
    qwen_vl_checkpoint,
    qwen_vl_one_frame,
    qwen_vl_pixels,
)
from tests.router.fake_engine import MODEL_ID
from tests.router.router_harness import SERVED_MODEL, fake_stack, make_state

CHAT = "/v1/chat/completions"
REPLY = [5, 6, 7]


def _image(seed: int, height: int = 50, width: int = 90, mode: str = "RGB") -> Image.Image:
    channels = len(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels, mode=mode)


def _data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def _part(url: str, plain: bool = False) -> dict[str, Any]:
    return {"type": "image_url", "image_url": url if plain else {"url": url, "detail": "auto"}}


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return image_text_checkpoint(tmp_path_factory.mktemp("mistral3"))


@pytest.fixture(scope="module")
def image_prompts(folder: pathlib.Path) -> PromptProcessor:
    return PromptProcessor.from_model_dir(folder)


@pytest.fixture(scope="module")
def images(folder: pathlib.Path, image_prompts: PromptProcessor) -> ModelImages:
    return ModelImages.from_model_dir(folder, image_prompts.tokenizer)


@pytest.fixture(scope="module")
def client(image_prompts: PromptProcessor, images: ModelImages) -> Iterator[TestClient]:
    """The image model's router without engines: every refusal comes before anything is sent."""
    with TestClient(create_app(make_state(image_prompts, redis_url=None, images=images))) as test_client:
        yield test_client


def _rendered(prompts: PromptProcessor, messages: list[dict[str, Any]]) -> list[int]:
    """The template over transformers' parts ({"type": "image"}), tokenized."""
    text = prompts.tokenizer.apply_chat_template(_template_parts(messages), tokenize=False, add_generation_prompt=True)
    return list(prompts.tokenizer.encode(text, add_special_tokens=False))


def _expected(folder: pathlib.Path, prompts: PromptProcessor, messages: list[dict[str, Any]],
              pictures: list[Image.Image]) -> tuple[list[int], list[tuple[int, int]], list[Any]]:
    """The reference: the rendered prompt, each image token expanded as Pixtral's processor does; each image's
    pixels as transformers' processor makes them."""
    rendered = _rendered(prompts, messages)
    pixels = [image_pixels(folder, picture) for picture in pictures]
    ids, spans = expand_image_tokens(rendered, [(h, w) for _, h, w in pixels])
    return ids, spans, pixels


def _template_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers' processors take them: each image part a {"type": "image"}."""
    return [{**m, "content": [_text(p["text"]) if p["type"] == "text" else {"type": "image"} for p in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]


def _sent(redis_url: str, prompts: PromptProcessor, images: ModelImages, messages: list[dict[str, Any]]
          ) -> GenerateRequest:
    """What the engines get for a chat completion of ``messages`` (through a router before fake engines)."""
    with fake_stack(redis_url, prompts, REPLY, images=images) as (server, cluster):
        response = httpx.post(f"{server.url}{CHAT}", json={"messages": messages, "max_tokens": 2}, timeout=10)
        assert response.status_code == 200, response.text
        [sent] = cluster.requests()
    return sent


def _check_images(sent: GenerateRequest, ids: list[int], spans: list[tuple[int, int]], pixels: list[Any]) -> None:
    assert sent.prompt_token_ids == ids
    assert [(i.offset, i.length) for i in sent.images] == spans
    for image, (values, height, width) in zip(sent.images, pixels, strict=True):
        assert (image.height, image.width) == (height, width)
        assert image.pixel_values == values.numpy().tobytes()
        assert image.digest == image_digest(image.pixel_values, height, width)


def test_the_engines_get_the_expanded_prompt_and_the_processed_pixels(
    redis_url: str, folder: pathlib.Path, image_prompts: PromptProcessor, images: ModelImages
) -> None:
    pictures = [_image(1), _image(2, 40, 30), _image(3, 20, 20, mode="RGBA")]
    messages = [
        {"role": "system", "content": "w9 w10"},
        {"role": "user", "content": [_text("w11 "), _part(_data_url(pictures[0])), _text(" w12"),
                                     _part(_data_url(pictures[1], "JPEG"), plain=True)]},
        {"role": "assistant", "content": "w13"},
        {"role": "user", "content": [_part(_data_url(pictures[2], "WEBP")), _text(" w14")]},
    ]
    # A JPEG and a WebP image are lossy: the reference reads the same decoded pixels.
    decoded = [Image.open(io.BytesIO(base64.b64decode(_data_url(p, f).split(",", 1)[1]))) for p, f in
               zip(pictures, ("PNG", "JPEG", "WEBP"), strict=True)]
    ids, spans, pixels = _expected(folder, image_prompts, messages, decoded)
    assert len(ids) > 3 * 16 and len(spans) == 3  # past a block: sent to a prefill instance
    with fake_stack(redis_url, image_prompts, REPLY, images=images) as (server, cluster):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=3,
                                               extra_body={"return_token_ids": True})
        assert reply.choices[0].message.content and reply.usage is not None
        assert reply.usage.prompt_tokens == len(ids)
        assert reply.prompt_token_ids == ids
        [sent] = cluster.requests()
        assert sent.decode_target is not None
        _check_images(sent, ids, spans, pixels)
        # A stream takes them as well, from the processed-image cache: three hits, which /metrics counts.
        assert images.processor is not None
        hits = images.processor.cache.hits
        chunks = list(client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=3,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        _check_images(cluster.requests()[-1], ids, spans, pixels)
        assert images.processor.cache.hits == hits + 3
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        cache = images.processor.cache
        assert f"pdserve:router_image_cache_hits_total {float(cache.hits)}" in metrics
        assert f"pdserve:router_image_cache_queries_total {float(cache.hits + cache.misses)}" in metrics


def test_a_migrated_request_takes_its_images_along(
    redis_url: str, folder: pathlib.Path, image_prompts: PromptProcessor, images: ModelImages
) -> None:
    picture = _image(4)
    messages = [{"role": "user", "content": [_part(_data_url(picture)), _text("w20")]}]
    ids, spans, pixels = _expected(folder, image_prompts, messages, [picture])
    with fake_stack(redis_url, image_prompts, REPLY, {"mode": "transfer-fail-once"}, images=images) as (server, cluster):
        response = httpx.post(f"{server.url}{CHAT}", json={"messages": messages, "max_tokens": 3}, timeout=10)
        assert response.status_code == 200, response.text
        first, again = cluster.requests()
        assert again.request_id == first.request_id + ".m1"
        for sent in (first, again):
            _check_images(sent, ids, spans, pixels)


def test_each_step_of_a_beam_search_takes_the_prompt_s_images_along(
    redis_url: str, folder: pathlib.Path, image_prompts: PromptProcessor, images: ModelImages
) -> None:
    """``use_beam_search`` sends each live beam to the engines as a prompt of its own, a token at a time: every one
    of those prompts is the conversation's expanded prompt and its beam's tokens, with the image's pixels and span."""
    picture = _image(5)
    messages = [{"role": "user", "content": [_part(_data_url(picture)), _text("w21")]}]
    ids, spans, pixels = _expected(folder, image_prompts, messages, [picture])
    with fake_stack(redis_url, image_prompts, REPLY, images=images) as (server, cluster):
        body = {"messages": messages, "max_tokens": 3, "n": 2, "use_beam_search": True}
        response = httpx.post(f"{server.url}{CHAT}", json=body, timeout=10)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 2
        sent = cluster.requests()
        assert len(sent) > 3  # the first step, then each live beam's steps
        lengths = set()
        for step in sent:
            assert step.prompt_token_ids[: len(ids)] == ids
            lengths.add(len(step.prompt_token_ids) - len(ids))
            _check_images(msgspec.structs.replace(step, prompt_token_ids=ids), ids, spans, pixels)
        assert lengths == {0, 1, 2}  # the beams' tokens so far follow the prompt


def test_prefix_routing_hashes_the_image_with_its_tokens(
    redis_url: str, folder: pathlib.Path, image_prompts: PromptProcessor, images: ModelImages
) -> None:
    """The instance holding the prompt's blocks under this image is chosen; one holding the same tokens
    with no image (or another one) is not."""
    picture = _image(5)
    messages = [{"role": "user", "content": [_part(_data_url(picture)), _text("w21 w22")]}]
    ids, spans, pixels = _expected(folder, image_prompts, messages, [picture])
    (offset, length), (values, height, width) = spans[0], pixels[0]
    digest = image_digest(values.numpy().tobytes(), height, width)
    with_image = compute_block_hashes(ids, 16, MODEL_ID, None, images=[(offset, length, digest)])
    without = compute_block_hashes(ids, 16, MODEL_ID, None)
    assert with_image[0] != without[0]
    with fake_stack(redis_url, image_prompts, REPLY, {"num_prefill": 3}, images=images) as (server, cluster):
        index = PrefixIndex(redis_url, server.state.config.namespace)
        assert index.add("prefill-1", without) and index.add("prefill-2", with_image)
        for _ in range(2):
            response = httpx.post(f"{server.url}{CHAT}", json={"messages": messages, "max_tokens": 2}, timeout=10)
            assert response.status_code == 200, response.text
        assert len(cluster.engine("prefill-2").requests) == 2


def test_tokenize_gives_the_expanded_prompt(
    client: TestClient, folder: pathlib.Path, image_prompts: PromptProcessor
) -> None:
    picture = _image(6)
    messages = [{"role": "user", "content": [_text("w30 "), _part(_data_url(picture))]}]
    ids, _, _ = _expected(folder, image_prompts, messages, [picture])
    response = client.post("/tokenize", json={"messages": messages})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == ids


def _refusal(response: httpx.Response, param: str, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def _chat(content: list[dict[str, Any]], role: str = "user", **fields: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL, "messages": [{"role": role, "content": content}], "max_tokens": 2, **fields}


PNG = _data_url(_image(7))
BAD_IMAGES = [
    # (content parts, param, words of the message)
    ([_part("https://example.com/cat.png")], "messages.0.content.0.image_url",
     "fetched only from the hosts --allowed-media-domains lists (none), not example.com"),
    ([_text("w3"), _part("file:///etc/passwd")], "messages.0.content.1.image_url", "http(s) URL or a data URL"),
    ([_part("data:text/plain;base64,aGVsbG8=")], "messages.0.content.0.image_url", "base64 data URL of an image"),
    ([_part("data:image/png,rawbytes")], "messages.0.content.0.image_url", "base64 data URL of an image"),
    ([_part("data:image/png;base64,not*base64!")], "messages.0.content.0.image_url", "not valid base64"),
    ([_part("data:image/png;base64," + base64.b64encode(b"no image here").decode())],
     "messages.0.content.0.image_url", "could not be decoded"),
    ([_part(_data_url(_image(8), "TIFF").replace("image/tiff", "image/png"))],  # a format not read
     "messages.0.content.0.image_url", "could not be decoded"),
    ([{"type": "image_url", "image_url": {"detail": "low"}}], "messages.0.content.0.image_url",
     "or an object with one as 'url'"),
    ([{"type": "input_audio", "input_audio": {}}], "messages.0.content.0", "only text and image_url"),
    ([_part(PNG)] * 5, "messages.0.content.4.image_url", "at most 4 image(s) (--limit-mm-per-prompt)"),
    ([_text("w3 [IMG] w4"), _part(PNG)], "messages", "placed 2 image token(s) for 1 image(s)"),
    ([_text("w3 " + "w4 " * 240), _part(PNG)], "messages", "maximum context length"),
]


@pytest.mark.parametrize(("content", "param", "words"), BAD_IMAGES)
def test_each_bad_image_is_refused_naming_its_field(
    client: TestClient, content: list[dict[str, Any]], param: str, words: str
) -> None:
    _refusal(client.post(CHAT, json=_chat(content)), param, words)


def test_images_in_other_messages_and_image_tokens_without_an_image_part(client: TestClient) -> None:
    _refusal(client.post(CHAT, json=_chat([_part(PNG)], role="assistant", add_generation_prompt=False)),
             "messages.0.content.0", "user messages only")
    # The image token's text in a message with images cannot move an image's span; without images it is text.
    _refusal(client.post(CHAT, json=_chat([_part(PNG), _text("[IMG]")])), "messages", "placed 2 image token")
    _refusal(client.post(CHAT, json=_chat([_text("w3 [IMG][IMG]"), _part(PNG), _part(PNG)])), "messages",
             "placed 4 image token(s) for 2 image(s)")
    # A prompt cut into its image is refused (one cut before it would move the spans).
    _refusal(client.post(CHAT, json=_chat([_part(PNG), _text(" w3 w4")], truncate_prompt_tokens=10)),
             "truncate_prompt_tokens", "into an image's tokens")
    # Pooling reads text only.
    _refusal(client.post("/v1/embeddings", json={"model": SERVED_MODEL, "messages": [
        {"role": "user", "content": [_part(PNG)]}]}), "messages.0.content.0", "pooling takes text only")


def test_a_decompression_bomb_is_refused_before_its_pixels_are_decoded(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # the 50 x 90 image has 4,500
    # An image not sent before (one processed before comes from the processor cache, not decoded again).
    _refusal(client.post(CHAT, json=_chat([_part(_data_url(_image(99)))])), "messages.0.content.0.image_url",
             "more than 1000 pixels")


def test_limit_mm_per_prompt_is_vllm_s_flag(image_prompts: PromptProcessor, images: ModelImages) -> None:
    assert limit_mm_per_prompt_arg('{"image": 2}') == 2
    assert limit_mm_per_prompt_arg('{"image": 0, "video": 0}') == 0
    assert build_parser().parse_args([]).limit_mm_per_prompt == 4
    assert build_parser().parse_args(["--limit-mm-per-prompt", '{"image": 1}']).limit_mm_per_prompt == 1
    for bad, words in [('{"image": 65}', "at most 64"), ('{"video": 1}', "video inputs are not served"),
                       ('{"image": -1}', "a count"), ("[4]", "JSON object")]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            limit_mm_per_prompt_arg(bad)
    state = make_state(image_prompts, redis_url=None, images=images, limits=RequestLimits(max_images_per_prompt=1))
    with TestClient(create_app(state)) as one:
        _refusal(one.post(CHAT, json=_chat([_part(PNG), _part(PNG)])), "messages.0.content.1.image_url",
                 "at most 1 image(s)")


def test_a_conversation_s_images_are_processed_once_and_the_cache_keeps_its_bytes(
    folder: pathlib.Path, image_prompts: PromptProcessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's ``--mm-processor-cache-gb``: an image sent again (by the same bytes) is not decoded or processed
    again, and its prompt and pixels are the same; the least recently used image goes first past the capacity,
    and one larger than it is never kept; 0 keeps none."""
    pictures = [_data_url(_image(seed)) for seed in (51, 52, 53)]
    ids = [*_rendered(image_prompts, [{"role": "user", "content": [_part(PNG), _text(" w3")]}])]
    fresh = ModelImages.from_model_dir(folder, image_prompts.tokenizer).processor
    assert fresh is not None and fresh.cache.capacity == 4 << 30
    size = len(fresh.prepare(ids, [ImageRef("p", pictures[0])])[1][0].pixel_values)
    processor = ModelImages.from_model_dir(folder, image_prompts.tokenizer, cache_bytes=2 * size).processor
    assert processor is not None
    runs: list[Any] = []
    run = processor.family.run
    monkeypatch.setattr(processor.family, "run", lambda image, options: runs.append(image) or run(image, options))

    def prepare(k: int) -> Any:
        return processor.prepare(ids, [ImageRef("p", pictures[k])])

    first = prepare(0)
    assert prepare(0) == first and len(runs) == 1  # the same ids, span, pixels and digest, processed once
    assert (processor.cache.hits, processor.cache.misses) == (1, 1)
    prepare(1)
    prepare(0)  # 0 now the most recently used
    prepare(2)  # past two images' bytes: 1 goes
    assert len(runs) == 3 and processor.cache.size == 2 * size
    prepare(0)
    assert len(runs) == 3
    prepare(1)
    assert len(runs) == 4
    for capacity in (0, size - 1):
        none = ModelImages.from_model_dir(folder, image_prompts.tokenizer, cache_bytes=capacity).processor
        assert none is not None
        assert none.prepare(ids, [ImageRef("p", pictures[0])]) == first
        none.prepare(ids, [ImageRef("p", pictures[0])])
        assert none.cache.hits == 0 and none.cache.size == 0
    assert build_parser().parse_args([]).mm_processor_cache_gb == 4.0
    assert build_parser().parse_args(["--mm-processor-cache-gb", "0"]).mm_processor_cache_gb == 0.0
    for bad in ("-1", "nan", "inf", "lots"):
        with pytest.raises(argparse.ArgumentTypeError, match="--mm-processor-cache-gb"):
            mm_processor_cache_gb_arg(bad)


def test_a_text_model_and_an_image_text_model_served_as_text_refuse_images_by_name(
    tmp_path: pathlib.Path, image_prompts: PromptProcessor, prompts: PromptProcessor
) -> None:
    # A LLaVA checkpoint whose vision tower is not implemented: its text is served.
    llava = tmp_path / "llava"
    llava.mkdir()
    (llava / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": {},
                                                   "vision_config": {"model_type": "dinov2"}}))
    # A Llama 4 checkpoint: its images are not implemented at all.
    llama4 = tmp_path / "llama4"
    llama4.mkdir()
    (llama4 / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": {}, "vision_config": {}}))
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert ModelImages.from_model_dir(llama, image_prompts.tokenizer) == ModelImages()
    served_as_text = ModelImages.from_model_dir(llava, image_prompts.tokenizer)
    assert served_as_text.processor is None and served_as_text.model_type == "llava"
    llama4_text = ModelImages.from_model_dir(llama4, image_prompts.tokenizer)
    assert llama4_text.processor is None and llama4_text.model_type == "llama4"
    for state, words in [
        (make_state(image_prompts, redis_url=None, images=served_as_text),
         "image input for a llava checkpoint with a 'dinov2' vision tower is not implemented"),
        (make_state(image_prompts, redis_url=None, images=llama4_text),
         "image input for model type 'llama4' is not implemented"),
        (make_state(prompts, redis_url=None), "this model takes no images"),  # the default model
    ]:
        with TestClient(create_app(state)) as test_client:
            for path in (CHAT, "/tokenize"):
                _refusal(test_client.post(path, json=_chat([_text("hi"), _part(PNG)])),
                         "messages.0.content.1", words)


def test_a_processor_whose_image_token_is_not_the_model_s_is_refused_at_start(
    tmp_path: pathlib.Path, folder: pathlib.Path, image_prompts: PromptProcessor
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "preprocessor_config.json", "processor_config.json"):
        (other / name).write_text((folder / name).read_text())
    spec = json.loads((other / "processor_config.json").read_text())
    (other / "processor_config.json").write_text(json.dumps({**spec, "image_token": "[IMG_BREAK]"}))
    with pytest.raises(ValueError, match=f"image token is id {IMAGE_TOKENS['[IMG_BREAK]']}"):
        ModelImages.from_model_dir(other, image_prompts.tokenizer)
    (other / "processor_config.json").write_text(json.dumps({**spec, "image_token": "<no such token>"}))
    with pytest.raises(ValueError, match="not one token of the tokenizer"):
        ModelImages.from_model_dir(other, image_prompts.tokenizer)


# Qwen2.5-VL and Qwen2-VL: the processor's patches and a run of <|image_pad|> per image.
@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def qwen_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return qwen_vl_checkpoint(tmp_path_factory.mktemp(request.param), model_type=request.param)


@pytest.fixture(scope="module")
def qwen_prompts(qwen_folder: pathlib.Path) -> PromptProcessor:
    return PromptProcessor.from_model_dir(qwen_folder)


@pytest.fixture(scope="module")
def qwen_images(qwen_folder: pathlib.Path, qwen_prompts: PromptProcessor) -> ModelImages:
    return ModelImages.from_model_dir(qwen_folder, qwen_prompts.tokenizer)


def _expected_qwen(folder: pathlib.Path, prompts: PromptProcessor, messages: list[dict[str, Any]],
                   pictures: list[Image.Image]) -> tuple[list[int], list[tuple[int, int]], list[Any]]:
    """The reference: the rendered prompt, each <|image_pad|> expanded as Qwen2.5-VL's processor does; each
    image's patches as transformers' processor makes them, one of their two equal frames, with the resized image's
    height and width."""
    processed = [qwen_vl_pixels(folder, picture) for picture in pictures]
    ids, spans = expand_qwen_vl_tokens(_rendered(prompts, messages), [grid for _, grid in processed])
    patch = QWEN_VL_PATCH[json.loads((folder / "config.json").read_text())["model_type"]]
    return ids, spans, [(qwen_vl_one_frame(patches), h * patch, w * patch) for patches, (_, h, w) in processed]


def test_qwen_vl_images_reach_the_engines_as_its_processor_makes_them(
    redis_url: str, qwen_folder: pathlib.Path, qwen_prompts: PromptProcessor, qwen_images: ModelImages
) -> None:
    assert qwen_images.model_type == json.loads((qwen_folder / "config.json").read_text())["model_type"]
    assert qwen_images.processor is not None
    pictures = [_image(11, 200, 300), _image(12, 50, 90)]
    messages = [{"role": "user", "content": [_text("w11 "), _part(_data_url(pictures[0])), _text(" w12"),
                                             _part(_data_url(pictures[1]), plain=True), _text(" w13")]}]
    ids, spans, pixels = _expected_qwen(qwen_folder, qwen_prompts, messages, pictures)
    pad, start, end = (QWEN_VL_TOKENS[t] for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    assert [length for _, length in spans] == [54, 6]  # 12 x 18 and 4 x 6 patches, 2 x 2 a token
    for offset, length in spans:  # the run of pads alone, between the template's start and end tokens
        assert ids[offset - 1] == start and ids[offset:offset + length] == [pad] * length
        assert ids[offset + length] == end
    with fake_stack(redis_url, qwen_prompts, REPLY, images=qwen_images) as (server, cluster):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=3,
                                               extra_body={"return_token_ids": True})
        assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
        assert reply.prompt_token_ids == ids
        [sent] = cluster.requests()
        _check_images(sent, ids, spans, pixels)
        # One frame of each 14 x 14 patch (the processor's two are equal): half its 1,176 values.
        assert [len(i.pixel_values) for i in sent.images] == [216 * 588 * 4, 24 * 588 * 4]


@pytest.fixture(scope="module")
def qwen_client(qwen_prompts: PromptProcessor, qwen_images: ModelImages) -> Iterator[TestClient]:
    with TestClient(create_app(make_state(qwen_prompts, redis_url=None, images=qwen_images))) as test_client:
        yield test_client


def test_qwen_vl_tokenize_and_placeholder_refusals(
    qwen_client: TestClient, qwen_folder: pathlib.Path, qwen_prompts: PromptProcessor
) -> None:
    picture = _image(13, 60, 40)
    messages = [{"role": "user", "content": [_text("w30 "), _part(_data_url(picture))]}]
    ids, _, _ = _expected_qwen(qwen_folder, qwen_prompts, messages, [picture])
    response = qwen_client.post("/tokenize", json={"messages": messages})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == ids
    # The image token's text moves no image's span: counted with the template's, the count is refused.
    _refusal(qwen_client.post(CHAT, json=_chat([_text("w3 <|image_pad|>"), _part(PNG)])), "messages",
             "placed 2 image token(s) for 1 image(s)")
    _refusal(qwen_client.post("/tokenize", json={"messages": [{"role": "user", "content": [
        _part(PNG), _part(PNG), _text("<|image_pad|>")]}]}), "messages", "placed 3 image token(s) for 2 image(s)")
    # An aspect ratio past the processor's bound (200) is refused naming the image.
    _refusal(qwen_client.post(CHAT, json=_chat([_text("w3"), _part(_data_url(_image(14, 2, 500)))])),
             "messages.0.content.1.image_url", "could not be processed")


def test_qwen_vl_folders_that_do_not_fit_are_refused_at_start(
    tmp_path: pathlib.Path, qwen_folder: pathlib.Path, qwen_prompts: PromptProcessor
) -> None:
    from common.model.arch import IMAGE_INPUT_TYPES

    assert set(IMAGE_INPUT_TYPES) <= set(IMAGE_FAMILIES)
    config = json.loads((qwen_folder / "config.json").read_text())
    spec = json.loads((qwen_folder / "preprocessor_config.json").read_text())
    tokenizer = qwen_prompts.tokenizer

    def folder(config: dict[str, Any], spec: dict[str, Any]) -> pathlib.Path:
        (tmp_path / "config.json").write_text(json.dumps(config))
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(spec))
        return tmp_path

    # Qwen2.5-VL's own folders hold the language model's fields at the top, not in a text_config.
    flat = config["text_config"] | {k: v for k, v in config.items() if k != "text_config"}
    images = ModelImages.from_model_dir(folder(flat, spec), tokenizer)
    assert images.processor is not None and isinstance(images.processor.family, QwenVLImages)
    assert images.processor.placeholder_id == QWEN_VL_TOKENS["<|image_pad|>"]
    for bad_config, bad_spec, words in [
        ({**config, "image_token_id": QWEN_VL_TOKENS["<|vision_end|>"]}, spec,
         f"image token is id {QWEN_VL_TOKENS['<|image_pad|>']}, the model's image_token_id"),
        (config, {**spec, "patch_size": 16}, "patch_size is 16, the vision tower's patch_size 14"),
        (config, {**spec, "merge_size": 1}, "merge_size is 1, the vision tower's spatial_merge_size 2"),
    ]:
        with pytest.raises(ValueError, match=words):
            ModelImages.from_model_dir(folder(bad_config, bad_spec), tokenizer)
    # A tokenizer without <|image_pad|> as one token (the Mistral folder's).
    image_text = tmp_path / "no_pad"
    image_text.mkdir()
    (image_text / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'<|image_pad|>' is not one token"):
        ModelImages.from_model_dir(image_text, PromptProcessor.from_model_dir(
            image_text_checkpoint(tmp_path / "mistral")).tokenizer)


# Images by URL: a real HTTP server on this host, fetched from only where --allowed-media-domains says.
class _ImageServer(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
    # "/slow" answers only once the test has seen the fetch time out (or after a generous deadline).
    release = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        status, headers, body = self.routes.get(self.path, (404, {}, b""))
        if self.path == "/slow":
            self.release.wait(timeout=60)
        self.send_response(status)
        for key, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageServer)
    port = server.server_address[1]
    png = base64.b64decode(_data_url(_image(11)).split(",", 1)[1])
    _ImageServer.routes = {
        "/cat.png": (200, {"Content-Type": "image/png"}, png),
        "/moved": (302, {"Location": "/cat.png"}, b""),
        "/elsewhere": (302, {"Location": f"http://localhost:{port}/cat.png"}, b""),  # another host name
        "/loop": (302, {"Location": "/loop"}, b""),
        "/big": (200, {}, b"\0" * (65 << 10)),
        "/slow": (200, {}, png),
        "/gone": (404, {}, b""),
    }
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    _ImageServer.release.set()
    server.shutdown()
    server.server_close()


def test_image_urls_are_fetched_from_the_allowed_hosts_only(
    redis_url: str, folder: pathlib.Path, image_prompts: PromptProcessor, image_server: str
) -> None:
    """An allowed host's image, directly or through a redirect, reaches the engines as the same image inline
    would; another host, a redirect to one, a loop, a failure, too many bytes or too long a fetch is a 400
    naming the image's field."""
    fetcher = ImageFetcher(["127.0.0.1"], timeout_s=1.0, max_bytes=64 << 10)
    fetching = ModelImages.from_model_dir(folder, image_prompts.tokenizer, fetcher)
    param = "messages.0.content.1.image_url"
    with fake_stack(redis_url, image_prompts, REPLY, images=fetching) as (server, cluster):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        inline = [_text("w11 " * 20), _part(_data_url(_image(11)))]
        for url in (f"{image_server}/cat.png", f"{image_server}/moved"):
            messages = [{"role": "user", "content": [inline[0], _part(url)]}]
            client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
            client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": inline}],
                                           max_tokens=2)  # type: ignore[arg-type]
            by_url, by_data = cluster.requests()[-2:]
            assert by_url.images and by_url.prompt_token_ids == by_data.prompt_token_ids
            assert by_url.images[0].pixel_values == by_data.images[0].pixel_values
        for path, words in (("/elsewhere", "not localhost"), ("/loop", "redirected more than 3 times"),
                            ("/gone", "HTTP 404"), ("/big", "more than 65536 bytes"), ("/slow", "more than 1 s")):
            response = httpx.post(f"{server.url}{CHAT}", timeout=10, json=_chat(
                [_text("w3"), _part(image_server + path)]))
            _refusal(response, param, words)
        _ImageServer.release.set()  # the slow answer may go now: the fetch gave up on it
        port = image_server.rsplit(":", 1)[1]
        _refusal(httpx.post(f"{server.url}{CHAT}", timeout=10, json=_chat(
            [_text("w3"), _part(f"http://localhost:{port}/cat.png")])), param, "not localhost")


def test_qwen3_vl_images_reach_the_engines_as_its_processor_makes_them(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Qwen3-VL's processing is Qwen2.5-VL's over patches of 16 pixels (32 a token's side)."""
    folder = qwen_vl_checkpoint(tmp_path_factory.mktemp("qwen3_vl"), model_type="qwen3_vl")
    prompts = PromptProcessor.from_model_dir(folder)
    images = ModelImages.from_model_dir(folder, prompts.tokenizer)
    assert images.model_type == "qwen3_vl" and images.processor is not None
    pictures = [_image(13, 200, 300)]
    messages = [{"role": "user", "content": [_text("w11 "), _part(_data_url(pictures[0])), _text(" w12")]}]
    ids, spans, pixels = _expected_qwen(folder, prompts, messages, pictures)
    assert [length for _, length in spans] == [54]  # resized to 192 x 288: 12 x 18 patches of 16, 2 x 2 a token
    with fake_stack(redis_url, prompts, REPLY, images=images) as (server, cluster):
        response = httpx.post(f"{server.url}{CHAT}", json={"messages": messages, "max_tokens": 2}, timeout=10)
        assert response.status_code == 200, response.text
        [sent] = cluster.requests()
        _check_images(sent, ids, spans, pixels)


def test_gemma3_images_reach_the_engines_as_its_processor_makes_them(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Gemma 3's processor expands each ``<start_of_image>`` of the rendered text, two newlines either side, before
    tokenizing: a newline of the message's text and the processor's merge into one token (``\\n\\n\\n``). The ids,
    spans and pixels equal transformers' ``Gemma3Processor``'s."""
    from transformers import AutoProcessor

    folder = gemma3_image_checkpoint(tmp_path_factory.mktemp("gemma3"))
    prompts = PromptProcessor.from_model_dir(folder)
    images = ModelImages.from_model_dir(folder, prompts.tokenizer)
    assert images.model_type == "gemma3" and images.processor is not None
    pictures = [_image(21, 200, 300), _image(22, 50, 90)]
    messages = [{"role": "user", "content": [_text("w11\n"), _part(_data_url(pictures[0])), _text("\nw12 "),
                                             _part(_data_url(pictures[1]), plain=True), _text(" w13")]}]
    parts = _template_parts(messages)
    text = prompts.tokenizer.apply_chat_template(parts, tokenize=False, add_generation_prompt=True)
    reference = AutoProcessor.from_pretrained(str(folder))(text=text, images=pictures, add_special_tokens=False,
                                                           return_tensors="np")
    ids = reference["input_ids"][0].tolist()
    boi, soft, eoi = (GEMMA3_TOKENS[t] for t in ("<start_of_image>", "<image_soft_token>", "<end_of_image>"))
    spans = [(k, 18) for k, t in enumerate(ids) if t == boi]
    assert ids.count(prompts.tokenizer.convert_tokens_to_ids("\n\n\n")) == 2  # merged on either side of image 0
    assert [ids[o:o + n] for o, n in spans] == [[boi, *[soft] * 16, eoi]] * 2
    pixels = [(reference["pixel_values"][k], 56, 56) for k in range(2)]
    with fake_stack(redis_url, prompts, REPLY, images=images) as (server, cluster):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=3,
                                               extra_body={"return_token_ids": True})
        assert reply.prompt_token_ids == ids
        [sent] = cluster.requests()
        assert sent.prompt_token_ids == ids and [(i.offset, i.length) for i in sent.images] == spans
        for image, (values, height, width) in zip(sent.images, pixels, strict=True):
            assert (image.height, image.width) == (height, width)
            assert image.pixel_values == values.astype(np.float32).tobytes()
        response = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=10)
        assert response.status_code == 200, response.text
        assert response.json()["tokens"] == ids
        # A message's text may hold neither the image token nor the placeholder.
        for words in ("<image_soft_token>", "<start_of_image>"):
            bad = _chat([_text(f"w3 {words}"), _part(PNG)])
            _refusal(httpx.post(f"{server.url}{CHAT}", json=bad, timeout=10), "messages", "image token")


@pytest.mark.parametrize("model_type", ["smolvlm", "idefics3"])
def test_idefics3_images_reach_the_engines_as_its_processor_makes_them(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory, model_type: str
) -> None:
    """Idefics3's and SmolVLM's processor (the same text for an image; SmolVLM's class needs num2words, so
    Idefics3's is the reference for both): each ``<image>`` becomes its grid's text before tokenizing, its pixels
    the tiles row by row and the whole image. A wide image in 2 x 2 tiles, a tall one in 2 x 1; with splitting
    turned off, one tile each. The ids and pixels equal the processor's."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    folder = idefics3_checkpoint(tmp_path_factory.mktemp(model_type), model_type)
    pictures = [_image(41, 200, 300), _image(42, 50, 15)]
    messages = [{"role": "user", "content": [_text("w11 "), _part(_data_url(pictures[0])), _text(" w12"),
                                             _part(_data_url(pictures[1])), _text(" w13")]}]
    parts = _template_parts(messages)
    for split, grids in ((True, [(56, 56), (56, 28)]), (False, [(28, 28), (28, 28)])):
        spec_file = folder / "preprocessor_config.json"
        spec_file.write_text(json.dumps({**json.loads(spec_file.read_text()), "do_image_splitting": split}))
        prompts = PromptProcessor.from_model_dir(folder)
        images = ModelImages.from_model_dir(folder, prompts.tokenizer)
        assert images.model_type == model_type and images.processor is not None
        sent = _sent(redis_url, prompts, images, messages)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))  # the processor adds a token to its tokenizer
        reference = Idefics3Processor(AutoImageProcessor.from_pretrained(str(folder), backend="pil"), tokenizer,
                                      image_seq_len=IDEFICS3_TILE_TOKENS)(
            text=prompts.tokenizer.apply_chat_template(parts, tokenize=False, add_generation_prompt=True),
            images=pictures, add_special_tokens=False, return_tensors="np")
        ids = reference["input_ids"][0].tolist()
        assert sent.prompt_token_ids == ids
        assert [(i.height, i.width) for i in sent.images] == grids
        tiles = [h // 28 * w // 28 + 1 if split else 1 for h, w in grids]
        # Per tile its tokens after a fake token and a row/column (or global) token; a fake token at the end; a
        # newline token per row (the last one's two newlines one token).
        assert [i.length for i in sent.images] == [n * (IDEFICS3_TILE_TOKENS + 2) + 1 + int(split) * h // 28
                                                   for n, (h, _) in zip(tiles, grids, strict=True)]
        assert [ids[i.offset] for i in sent.images] == [IDEFICS3_TOKENS["<fake_token_around_image>"]] * 2
        assert b"".join(i.pixel_values for i in sent.images) == reference["pixel_values"][0].astype(
            np.float32).tobytes()
    # A folder whose tiles hold another count of features than its processor writes tokens for fails start-up.
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "scale_factor": 1}))
    with pytest.raises(ValueError, match="image_seq_len 4 is not the model's 16 features of a tile"):
        ModelImages.from_model_dir(folder, prompts.tokenizer)
    (folder / "config.json").write_text(json.dumps(config))
    # A tokenizer whose token around an image strips the newline before it: the router's ids would not be the
    # processor's, so its images are refused (its text served).
    file = folder / "tokenizer.json"
    spec = json.loads(file.read_text())
    for token in spec["added_tokens"]:
        token["lstrip"] = token["content"] == "<fake_token_around_image>"
    file.write_text(json.dumps(spec))
    stripping = ModelImages.from_model_dir(folder, AutoTokenizer.from_pretrained(str(folder)))
    assert stripping.processor is None and "merges an image's text with the text around it" in stripping.refusal


def test_llava_next_images_reach_the_engines_as_its_processor_makes_them(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """LLaVA-NeXT's processor: ``<image>`` once per feature of the image's grid (a wide, a tall and a square image:
    1 x 2, 2 x 1 and 2 x 2 tiles, their padding cut), its tiles' pixels, its size as sent. The ids and pixels equal
    transformers' ``LlavaNextProcessor``'s."""
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaNextProcessor

    folder = llava_next_checkpoint(tmp_path_factory.mktemp("llava-next"))
    prompts = PromptProcessor.from_model_dir(folder)
    images = ModelImages.from_model_dir(folder, prompts.tokenizer)
    assert images.model_type == "llava_next" and images.processor is not None
    pictures = [_image(61, 100, 300), _image(62, 90, 40), _image(63, 70, 80)]
    messages = [{"role": "user", "content": [_text("w11 "), _part(_data_url(pictures[0])), _text(" w12"),
                                             _part(_data_url(pictures[1])), _part(_data_url(pictures[2])),
                                             _text(" w13")]}]
    parts = _template_parts(messages)
    sent = _sent(redis_url, prompts, images, messages)
    reference = LlavaNextProcessor(AutoImageProcessor.from_pretrained(str(folder), backend="pil"),
                                   AutoTokenizer.from_pretrained(str(folder)), patch_size=7,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1)(
        text=prompts.tokenizer.apply_chat_template(parts, tokenize=False, add_generation_prompt=True),
        images=pictures, add_special_tokens=False, return_tensors="np")
    assert sent.prompt_token_ids == reference["input_ids"][0].tolist()
    assert [(i.height, i.width) for i in sent.images] == [(100, 300), (90, 40), (70, 80)]
    tiles = [3, 3, 5]  # the grid's and the whole image's
    for image, values, n in zip(sent.images, reference["pixel_values"], tiles, strict=True):
        assert image.pixel_values == values[:n].astype(np.float32).tobytes()
    assert len({i.length for i in sent.images}) == 3  # each grid, less its padding, its own count
    # A tower other than CLIP's or SigLIP's, or a strategy that would not leave a feature per patch: its text served.
    config = json.loads((folder / "config.json").read_text())
    for vision_type, strategy, words in [("pixtral", "full", "'pixtral' vision tower"),
                                         ("clip_vision_model", "full", "strategy 'full' and a clip_vision_model")]:
        (folder / "config.json").write_text(json.dumps({
            **config, "vision_feature_select_strategy": strategy,
            "vision_config": {**config["vision_config"], "model_type": vision_type}}))
        refused = ModelImages.from_model_dir(folder, prompts.tokenizer)
        assert refused.processor is None and words in refused.refusal, refused.refusal


def _served(folder: pathlib.Path, model_type: str) -> tuple[PromptProcessor, ModelImages]:
    """The router's prompt processing and image processing of ``folder``, its images taken."""
    prompts = PromptProcessor.from_model_dir(folder)
    images = ModelImages.from_model_dir(folder, prompts.tokenizer)
    assert images.model_type == model_type and images.processor is not None
    return prompts, images


def _chat_one_image(server: Any, cluster: Any, picture: Image.Image) -> tuple[list[dict[str, Any]], GenerateRequest]:
    """A chat of ``w11``, ``picture`` and ``w13`` through the router to the fake engines: its messages, and the
    request the engines got."""
    messages = [{"role": "user", "content": [_text("w11 "), _part(_data_url(picture)), _text(" w13")]}]
    before = len(cluster.requests())
    response = httpx.post(f"{server.url}{CHAT}", json={"messages": messages, "max_tokens": 2}, timeout=10)
    assert response.status_code == 200, response.text
    [sent] = cluster.requests()[before:]
    return messages, sent


def test_internvl_images_reach_the_engines_as_its_processor_makes_them(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """InternVL: ``<IMG_CONTEXT>`` replaced by the text InternVL's processor writes for the image's tiles
    (transformers' ``replace_image_token``; its processor class itself needs a video processor, which needs
    torchvision), tokenized; the image processor's tiles with ``crop_to_patches``, as its processor runs it; the
    processed size a column of tiles. A folder whose ``image_seq_length`` is not the model's is refused at start."""
    from transformers import InternVLProcessor

    folder = internvl_checkpoint(tmp_path_factory.mktemp("internvl"))
    prompts, images = _served(folder, "internvl")
    picture = _image(72, 40, 90)
    with fake_stack(redis_url, prompts, REPLY, images=images) as (server, cluster):
        messages, sent = _chat_one_image(server, cluster, picture)
    pixels = internvl_pixels(folder, picture)
    assert len(pixels) == 3  # a 1 x 2 grid and the whole image
    processor = InternVLProcessor.__new__(InternVLProcessor)
    processor.start_image_token, processor.end_image_token = "<img>", "</img>"
    processor.image_token, processor.image_seq_length = "<IMG_CONTEXT>", INTERNVL_TILE_TOKENS
    text = processor.replace_image_token({"num_patches": [len(pixels)]}, 0)
    span = prompts.tokenizer.encode(text, add_special_tokens=False)
    rendered = _rendered(prompts, messages)
    at = rendered.index(INTERNVL_TOKENS["<IMG_CONTEXT>"])
    assert len(span) == 3 * INTERNVL_TILE_TOKENS + 2
    assert sent.prompt_token_ids == [*rendered[:at], *span, *rendered[at + 1:]]
    [image] = sent.images
    assert (image.height, image.width, image.offset, image.length) == (3 * INTERNVL_TILE, INTERNVL_TILE, at, len(span))
    assert image.pixel_values == pixels.numpy().tobytes()
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": 16}))
    with pytest.raises(ValueError, match="image_seq_length 16 is not the model's 4 features of a tile"):
        ModelImages.from_model_dir(folder, prompts.tokenizer)


def test_llava_onevision_images_reach_the_engines_as_its_processor_makes_them_alone_and_several(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """LLaVA-OneVision: ``<image>`` once per feature as its processor counts them (a 2 x 2 grid's resized to fit
    ``anyres_max_1``), the image processor's tiles, the size as sent. In a prompt of two images, each its
    whole-image tile alone and a tile's tokens and a newline's, as its processors make one sample of both; the
    same image sent alone again is processed with its grid (the cache keeps the two apart)."""
    folder = llava_onevision_checkpoint(tmp_path_factory.mktemp("llava-onevision"))
    prompts, images = _served(folder, "llava_onevision")
    picture, other = _image(71, 64, 64), _image(72, 30, 90)
    two = [{"role": "user", "content": [_part(_data_url(picture)), _text(" w3"), _part(_data_url(other))]}]
    with fake_stack(redis_url, prompts, REPLY, images=images) as (server, cluster):
        response = httpx.post(f"{server.url}{CHAT}", json={"messages": two, "max_tokens": 2}, timeout=10)
        assert response.status_code == 200, response.text
        [several] = cluster.requests()
        messages, sent = _chat_one_image(server, cluster, picture)
    pixels, height, width, count = llava_next_pixels(folder, picture)
    rendered = _rendered(prompts, messages)
    at = rendered.index(LLAVA_TOKENS["<image>"])
    assert count == 16 + 4 * 5  # the whole image's tile; the 8 x 8 grid resized to 4 x 4, a newline a row
    assert sent.prompt_token_ids == [*rendered[:at], *[LLAVA_TOKENS["<image>"]] * count, *rendered[at + 1:]]
    [image] = sent.images
    assert (image.height, image.width, image.offset, image.length) == (height, width, at, count)
    assert image.pixel_values == pixels.numpy().tobytes() and not image.whole_image_only
    expected = llava_onevision_sample_pixels(folder, [picture, other])
    ids, offset = _rendered(prompts, two), 0
    for k, (tile, height, width, count) in enumerate(expected):
        assert count == 16 + 1
        at = ids.index(LLAVA_TOKENS["<image>"], offset)
        ids[at:at + 1] = [LLAVA_TOKENS["<image>"]] * count
        got = several.images[k]
        assert (got.height, got.width, got.offset, got.length, got.whole_image_only) == (height, width, at, count, True)
        assert got.pixel_values == tile.numpy().tobytes()
        offset = at + count
    assert several.prompt_token_ids == ids


@pytest.mark.parametrize("tower", ["clip", "pixtral"])
def test_llava_images_reach_the_engines_as_its_processor_makes_them(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory, tower: str
) -> None:
    """LLaVA's processor (a CLIP tower: ``<image>`` once per feature, pixels of its one size): the ids and pixels
    equal transformers' processor's. A Pixtral tower's: Pixtral's processing, as Mistral 3's (whose processor class
    needs torchvision: the reference is its expansion and image processor's pixels, as for Mistral 3)."""
    from transformers import AutoProcessor

    folder = llava_checkpoint(tmp_path_factory.mktemp(f"llava-{tower}"), tower)
    prompts = PromptProcessor.from_model_dir(folder)
    images = ModelImages.from_model_dir(folder, prompts.tokenizer)
    assert images.model_type == "llava" and images.processor is not None
    pictures = [_image(31, 200, 300), _image(32, 50, 90)]
    messages = [{"role": "user", "content": [_text("w11 "), _part(_data_url(pictures[0])), _text(" w12"),
                                             _part(_data_url(pictures[1])), _text(" w13")]}]
    parts = _template_parts(messages)
    sent = _sent(redis_url, prompts, images, messages)
    if tower == "pixtral":
        _check_images(sent, *_expected(folder, prompts, messages, pictures))
        return
    text = prompts.tokenizer.apply_chat_template(parts, tokenize=False, add_generation_prompt=True)
    reference = AutoProcessor.from_pretrained(str(folder))(text=text, images=pictures, add_special_tokens=False,
                                                           return_tensors="np")
    assert sent.prompt_token_ids == reference["input_ids"][0].tolist()
    assert [(i.height, i.width, i.length) for i in sent.images] == [(28, 28, 16)] * 2
    for image, values in zip(sent.images, reference["pixel_values"], strict=True):
        assert image.pixel_values == values.astype(np.float32).tobytes()


def test_responses_api_input_images_reach_the_engines_as_a_chat_s(
    redis_url: str, folder: pathlib.Path, image_prompts: PromptProcessor, images: ModelImages
) -> None:
    """The Responses API's ``input_image`` parts: the engines get what the same chat completion sends them; a
    response continued by ``previous_response_id`` sends its image again; each refusal names its input part."""
    picture = _image(41)
    url = _data_url(picture)
    messages: list[dict[str, Any]] = [{"role": "user", "content": [_text("w11 "), _part(url), _text(" w12")]}]
    ids, spans, pixels = _expected(folder, image_prompts, messages, [picture])
    content = [{"type": "input_text", "text": "w11 "}, {"type": "input_image", "image_url": url, "detail": "auto"},
               {"type": "input_text", "text": " w12"}]
    with fake_stack(redis_url, image_prompts, REPLY, images=images) as (server, cluster):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        first = client.responses.create(model=SERVED_MODEL, input=[{"role": "user", "content": content}],
                                        max_output_tokens=3)
        assert first.output_text
        [sent] = cluster.requests()
        _check_images(sent, ids, spans, pixels)
        client.responses.create(model=SERVED_MODEL, previous_response_id=first.id, input="w13", max_output_tokens=3)
        conversation = [*messages, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "w13"}]
        _check_images(cluster.requests()[-1], *_expected(folder, image_prompts, conversation, [picture]))
        responses = f"{server.url}/v1/responses"
        for bad, param, words in [
            ({"type": "input_image", "file_id": "file-1"}, "input.0.content.1", "files are not served"),
            ({"type": "input_image", "image_url": "data:image/png;base64,???"}, "input.0.content.1.image_url",
             "not valid base64"),
        ]:
            body = {"model": SERVED_MODEL, "instructions": "w3",  # a system message first: the indices differ
                    "input": [{"role": "user", "content": [content[0], bad]}]}
            _refusal(httpx.post(responses, json=body, timeout=10), param, words)
        assistant = {"model": SERVED_MODEL, "input": [{"role": "assistant", "content": [content[1]]}]}
        _refusal(httpx.post(responses, json=assistant, timeout=10), "input.0.content.0", "user messages only")
