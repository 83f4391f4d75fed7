"""vLLM's ``mm_processor_kwargs`` (a chat completion's, a Responses request's, ``/tokenize``'s) and
``--mm-processor-kwargs`` (the server's, under a request's): the image processor's settings each family takes,
the pixels and ids equal to transformers' processor built with those settings, each setting not taken refused by
name, at start or with a 400."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from router.images import ImageRef, ModelImages
from router.main import build_parser
from router.openai_models import ChatRender
from router.tokenization import PromptProcessor
from tests.engine.tiny_models import (
    IDEFICS3_TILE,
    IDEFICS3_TILE_TOKENS,
    INTERNVL_TILE,
    INTERNVL_TILE_TOKENS,
    QWEN_VL_PATCH,
    QWEN_VL_TOKENS,
    gemma3_image_checkpoint,
    idefics3_checkpoint,
    internvl_checkpoint,
    internvl_pixels,
    qwen_vl_checkpoint,
    qwen_vl_one_frame,
    qwen_vl_pixels,
)
from tests.router.router_harness import SERVED_MODEL, fake_stack, make_state
from tests.router.test_images import CHAT, REPLY, _data_url, _image, _part, _refusal, _text

# The tiny Qwen2.5-VL folder's bounds on an image's pixels, in tokens of 28 x 28 (4 and 64).
STEP = 2 * QWEN_VL_PATCH["qwen2_5_vl"]
FOLDER_MAX_PIXELS = STEP * STEP * 64
SMALL = STEP * STEP * 16


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return qwen_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"), model_type="qwen2_5_vl")


@pytest.fixture(scope="module")
def qwen_prompts(qwen_folder: pathlib.Path) -> PromptProcessor:
    return PromptProcessor.from_model_dir(qwen_folder)


@pytest.fixture(scope="module")
def qwen_client(qwen_folder: pathlib.Path, qwen_prompts: PromptProcessor) -> Iterator[TestClient]:
    """The Qwen2.5-VL router without engines, the server's settings none: every refusal comes before anything is
    sent."""
    images = ModelImages.from_model_dir(qwen_folder, qwen_prompts.tokenizer)
    with TestClient(create_app(make_state(qwen_prompts, redis_url=None, images=images))) as client:
        yield client


def _qwen_reference(folder: pathlib.Path, picture: Any, **settings: Any) -> tuple[bytes, int, int]:
    """transformers' Qwen2-VL image processor from the folder's file with ``settings`` over it: the one frame the
    router sends, and the resized height and width."""
    patches, (_, rows, cols) = qwen_vl_pixels(folder, picture, **settings)
    patch = QWEN_VL_PATCH["qwen2_5_vl"]
    return qwen_vl_one_frame(patches).numpy().tobytes(), rows * patch, cols * patch


class Sent:
    """The requests fake engines got, one at a time: ``new()`` is the one request they got since the last call (the
    cluster lists its engines' requests engine by engine)."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.seen: set[str] = set()

    def new(self) -> Any:
        [request] = [r for r in self.cluster.requests() if r.request_id not in self.seen]
        self.seen.add(request.request_id)
        return request


def _messages(picture: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [_text("w11 "), _part(_data_url(picture)), _text(" w12")]}]


def test_qwen_vl_pixel_bounds_per_request_and_for_the_server(
    redis_url: str, qwen_folder: pathlib.Path, qwen_prompts: PromptProcessor
) -> None:
    """``max_pixels`` / ``min_pixels``: a request's resize the image as transformers' processor built with them
    does (fewer image tokens, the ids and pixels its); the same image without them is processed as the folder says
    (the processed-image cache keeps the two apart); ``/tokenize`` and the Responses API take them as the chat
    does. The server's ``--mm-processor-kwargs`` apply to every request, a request's over them."""
    picture = _image(21, 200, 300)
    messages = _messages(picture)
    pad = QWEN_VL_TOKENS["<|image_pad|>"]
    small = _qwen_reference(qwen_folder, picture, max_pixels=SMALL)
    full = _qwen_reference(qwen_folder, picture)
    tall = _image(22, 20, 30)
    grown = _qwen_reference(qwen_folder, tall, min_pixels=STEP * STEP * 30)
    assert small[1:] != full[1:] and small[1] * small[2] <= SMALL < full[1] * full[2]

    def check(sent: Any, expected: tuple[bytes, int, int]) -> None:
        [image] = sent.images
        assert (image.pixel_values, image.height, image.width) == expected
        assert image.length == (expected[1] // STEP) * (expected[2] // STEP)
        assert sent.prompt_token_ids[image.offset:image.offset + image.length] == [pad] * image.length
        assert sent.prompt_token_ids.count(pad) == image.length

    images = ModelImages.from_model_dir(qwen_folder, qwen_prompts.tokenizer)
    with fake_stack(redis_url, qwen_prompts, REPLY, images=images) as (server, cluster):
        sent = Sent(cluster)
        first_ids: list[int] = []
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for settings, expected in (({"max_pixels": SMALL}, small), (None, full), ({"max_pixels": SMALL}, small)):
            extra = {"mm_processor_kwargs": settings} if settings is not None else {}
            client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=2, extra_body=extra)
            request = sent.new()
            check(request, expected)
            first_ids = first_ids or request.prompt_token_ids
        client.chat.completions.create(model=SERVED_MODEL, messages=_messages(tall), max_tokens=2,
                                       extra_body={"mm_processor_kwargs": {"min_pixels": STEP * STEP * 30}})
        check(sent.new(), grown)
        tokenized = httpx.post(f"{server.url}/tokenize", timeout=10, json={
            "messages": messages, "mm_processor_kwargs": {"max_pixels": SMALL}})
        assert tokenized.status_code == 200, tokenized.text
        assert tokenized.json()["tokens"] == first_ids
        client.responses.create(model=SERVED_MODEL, max_output_tokens=2, extra_body={
            "mm_processor_kwargs": {"max_pixels": SMALL}}, input=[{"role": "user", "content": [
                {"type": "input_text", "text": "w11 "}, {"type": "input_image", "image_url": _data_url(picture)},
                {"type": "input_text", "text": " w12"}]}])
        check(sent.new(), small)
    # The server's: every request's, a request's over them.
    args = build_parser().parse_args(["--model", str(qwen_folder), "--mm-processor-kwargs",
                                      json.dumps({"max_pixels": SMALL})])
    images = ModelImages.from_model_dir(qwen_folder, qwen_prompts.tokenizer, options=args.mm_processor_kwargs)
    with fake_stack(redis_url, qwen_prompts, REPLY, images=images) as (server, cluster):
        sent = Sent(cluster)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=2)
        check(sent.new(), small)
        client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=2, extra_body={
            "mm_processor_kwargs": {"max_pixels": FOLDER_MAX_PIXELS}})
        check(sent.new(), full)
        # A request's min_pixels past the server's max_pixels
        _refusal(httpx.post(f"{server.url}{CHAT}", timeout=10, json={
            "messages": messages, "mm_processor_kwargs": {"min_pixels": SMALL + 1}}),
            "mm_processor_kwargs.min_pixels", f"at most max_pixels ({SMALL})")


@pytest.mark.parametrize(("settings", "param", "words"), [
    ({"max_pixels": FOLDER_MAX_PIXELS + 1}, "mm_processor_kwargs.max_pixels",
     f"at most the model folder's {FOLDER_MAX_PIXELS}"),
    ({"min_pixels": FOLDER_MAX_PIXELS + 1}, "mm_processor_kwargs.min_pixels",
     f"at most max_pixels ({FOLDER_MAX_PIXELS})"),
    ({"max_pixels": SMALL, "min_pixels": SMALL * 2}, "mm_processor_kwargs.min_pixels", f"at most max_pixels ({SMALL})"),
    ({"max_pixels": 0}, "mm_processor_kwargs.max_pixels", "must be a positive integer, got 0"),
    ({"max_pixels": True}, "mm_processor_kwargs.max_pixels", "must be a positive integer, got True"),
    ({"max_pixels": 1.5}, "mm_processor_kwargs.max_pixels", "must be a positive integer"),
    ({"fps": 2}, "mm_processor_kwargs.fps", "takes no such setting here (taken: min_pixels, max_pixels)"),
    ({"do_pan_and_scan": True}, "mm_processor_kwargs.do_pan_and_scan", "no such setting"),
    ([1], "mm_processor_kwargs", "must be an object"),
])
def test_qwen_vl_settings_not_taken_are_refused_by_name(
    qwen_client: TestClient, settings: Any, param: str, words: str
) -> None:
    body = {"messages": _messages(_image(23)), "mm_processor_kwargs": settings}
    _refusal(qwen_client.post(CHAT, json=body), param, words)
    # Checked whether or not the request holds an image, and by /tokenize too.
    _refusal(qwen_client.post(CHAT, json={**body, "messages": [{"role": "user", "content": "w11"}]}), param, words)
    _refusal(qwen_client.post("/tokenize", json=body), param, words)


def test_other_endpoints_and_models_refuse_the_settings(
    qwen_client: TestClient, qwen_folder: pathlib.Path, qwen_prompts: PromptProcessor, prompts: PromptProcessor,
    tmp_path: pathlib.Path,
) -> None:
    """Completions take no images; ``/tokenize`` takes the settings with messages only; a text model refuses any
    (at start too); the server's settings are checked at start, naming the flag, before any request."""
    _refusal(qwen_client.post("/v1/completions", json={"prompt": "w11", "mm_processor_kwargs": {"max_pixels": 1}}),
             "mm_processor_kwargs", "not yet implemented")
    _refusal(qwen_client.post("/tokenize", json={"prompt": "w11", "mm_processor_kwargs": {}}),
             "mm_processor_kwargs", "go with messages")
    with TestClient(create_app(make_state(prompts, redis_url=None))) as text_client:
        _refusal(text_client.post(CHAT, json={"messages": [{"role": "user", "content": "w11"}],
                                              "mm_processor_kwargs": {"max_pixels": SMALL}}),
                 "mm_processor_kwargs", "takes no images")
        ok = text_client.post("/tokenize", json={"messages": [{"role": "user", "content": "w11"}],
                                                 "mm_processor_kwargs": {}})
        assert ok.status_code == 200, ok.text
    with pytest.raises(ValueError, match=r"--mm-processor-kwargs.max_pixels: at most the model folder's"):
        ModelImages.from_model_dir(qwen_folder, qwen_prompts.tokenizer, options={"max_pixels": FOLDER_MAX_PIXELS + 1})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"--mm-processor-kwargs: this model takes no images"):
        ModelImages.from_model_dir(tmp_path, prompts.tokenizer, options={"max_pixels": SMALL})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--mm-processor-kwargs", "[1]"])


def test_idefics3_image_splitting_per_request(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``do_image_splitting`` false: the image as one tile, as transformers' processor built with it makes it (a
    tile's tokens after the global-image token); true where the folder splits is the folder's own processing;
    true where the folder does not split is refused (the engines' cache is sized for one tile)."""
    from transformers import AutoImageProcessor

    folder = idefics3_checkpoint(tmp_path_factory.mktemp("smolvlm"), "smolvlm")
    prompts = PromptProcessor.from_model_dir(folder)
    picture = _image(31, 200, 300)
    reference = AutoImageProcessor.from_pretrained(str(folder), backend="pil", do_image_splitting=False)(
        images=[picture], return_tensors="np")["pixel_values"][0].astype(np.float32).tobytes()
    split = AutoImageProcessor.from_pretrained(str(folder), backend="pil")(
        images=[picture], return_tensors="np")["pixel_values"][0].astype(np.float32).tobytes()
    images = ModelImages.from_model_dir(folder, prompts.tokenizer)
    with fake_stack(redis_url, prompts, REPLY, images=images) as (server, cluster):
        sent = Sent(cluster)
        # One tile: a fake token, the global-image token, its tokens and a fake token; 2 x 2 tiles and the whole
        # image: each tile's tokens after a fake token and its row/column (or global) token, a newline a row, a
        # fake token at the end.
        for settings, pixels, size, length in (
            ({"do_image_splitting": False}, reference, (IDEFICS3_TILE,) * 2, IDEFICS3_TILE_TOKENS + 3),
            ({"do_image_splitting": True}, split, (2 * IDEFICS3_TILE,) * 2, 5 * (IDEFICS3_TILE_TOKENS + 2) + 1 + 2),
        ):
            response = httpx.post(f"{server.url}{CHAT}", timeout=10, json={
                "messages": _messages(picture), "max_tokens": 2, "mm_processor_kwargs": settings})
            assert response.status_code == 200, response.text
            [image] = sent.new().images
            assert (image.pixel_values, (image.height, image.width), image.length) == (pixels, size, length)
    spec_file = folder / "preprocessor_config.json"
    spec_file.write_text(json.dumps({**json.loads(spec_file.read_text()), "do_image_splitting": False}))
    with pytest.raises(ValueError, match="does not split images"):
        ModelImages.from_model_dir(folder, prompts.tokenizer, options={"do_image_splitting": True})


def test_internvl_tiles_per_request(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``max_patches`` / ``min_patches`` / ``crop_to_patches``: the image's tiles as transformers' processor built
    with them makes them (as InternVL's processor runs it, ``crop_to_patches``), a span of their tokens; a
    ``max_patches`` past the folder's (3) refused."""
    folder = internvl_checkpoint(tmp_path_factory.mktemp("internvl"))
    prompts = PromptProcessor.from_model_dir(folder)
    images = ModelImages.from_model_dir(folder, prompts.tokenizer)
    picture = _image(32, 40, 90)
    cases = [({}, 3), ({"max_patches": 1}, 1), ({"crop_to_patches": False}, 1), ({"min_patches": 3}, 4)]
    with fake_stack(redis_url, prompts, REPLY, images=images) as (server, cluster):
        sent = Sent(cluster)
        for settings, tiles in cases:
            response = httpx.post(f"{server.url}{CHAT}", timeout=10, json={
                "messages": _messages(picture), "max_tokens": 2, "mm_processor_kwargs": settings})
            assert response.status_code == 200, response.text
            [image] = sent.new().images
            pixels = internvl_pixels(folder, picture, **settings)
            assert len(pixels) == tiles
            assert (image.pixel_values, image.height, image.width) == (
                pixels.numpy().tobytes(), tiles * INTERNVL_TILE, INTERNVL_TILE)
            assert image.length == tiles * INTERNVL_TILE_TOKENS + 2
        _refusal(httpx.post(f"{server.url}{CHAT}", timeout=10, json={
            "messages": _messages(picture), "mm_processor_kwargs": {"max_patches": 4}}),
            "mm_processor_kwargs.max_patches", "at most the model folder's 3")


# Crops of 16 pixels or more: the tiny checkpoint's images are small.
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}


def test_gemma3_pan_and_scan_per_request_and_in_the_folder(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Gemma 3's pan and scan: a wide image (3 crops), a tall one (2, at most ``pan_and_scan_max_num_crops``) and a
    square one (none) in one prompt; the ids, spans and pixels equal transformers' ``Gemma3Processor``'s with the
    same settings (its text around the crops, each crop an image of its own). Turned on in the folder's image
    processor, every request's; a request's false turns it off; 64 images and crops at most a prompt."""
    from transformers import AutoProcessor

    folder = gemma3_image_checkpoint(tmp_path_factory.mktemp("gemma3"))
    prompts = PromptProcessor.from_model_dir(folder)
    pictures = [_image(34, 50, 150), _image(35, 200, 60), _image(36, 40, 40)]
    messages = [{"role": "user", "content": [
        _text("w11\n"), _part(_data_url(pictures[0])), _text("\nw12 "), _part(_data_url(pictures[1])), _text(" w13"),
        _part(_data_url(pictures[2]))]}]
    parts = [{**m, "content": [_text(p["text"]) if p["type"] == "text" else {"type": "image"} for p in m["content"]]}
             for m in messages]
    text = prompts.tokenizer.apply_chat_template(parts, tokenize=False, add_generation_prompt=True)
    settings = {**PAN_AND_SCAN, "pan_and_scan_max_num_crops": 2}
    reference = AutoProcessor.from_pretrained(str(folder))(text=text, images=pictures, add_special_tokens=False,
                                                           return_tensors="np", **settings)
    plain = AutoProcessor.from_pretrained(str(folder))(text=text, images=pictures, add_special_tokens=False,
                                                       return_tensors="np")
    ids = reference["input_ids"][0].tolist()
    boi = prompts.tokenizer.convert_tokens_to_ids("<start_of_image>")
    spans = [(k, 18) for k, t in enumerate(ids) if t == boi]
    assert len(spans) == 7 == len(reference["pixel_values"])  # 2 crops each of the first two images, the third alone

    def check(sent: Any, expected: Any) -> None:
        assert sent.prompt_token_ids == expected["input_ids"][0].tolist()
        boi_at = [k for k, t in enumerate(sent.prompt_token_ids) if t == boi]
        assert [(i.offset, i.length) for i in sent.images] == [(k, 18) for k in boi_at]
        assert [i.pixel_values for i in sent.images] == [
            v.astype(np.float32).tobytes() for v in expected["pixel_values"]]
        assert len({i.digest for i in sent.images}) == len(sent.images)

    images = ModelImages.from_model_dir(folder, prompts.tokenizer)
    assert images.processor is not None
    # The text in place of each image's <start_of_image>, to the character (this word-level tokenizer's unknown
    # words are one id whatever they are): the processor's.
    processor = AutoProcessor.from_pretrained(str(folder))
    crops = {"num_crops": [2, 2, 0]}
    loaded = images.processor.load([ImageRef(f"p{k}", _data_url(p)) for k, p in enumerate(pictures)], None,
                                    images.processor.options(settings))
    assert [len(image.crops) for image in loaded] == crops["num_crops"]
    # Kept hashed, crops too: a conversation's next turn hashes none of them again.
    assert all(piece.digest for image in loaded for piece in image.pieces)
    render = images.processor.chat_render(ChatRender(), loaded)
    assert render.image_text is not None and render.image_text(f"a{processor.boi_token}b{processor.boi_token}c"
                                                                f"{processor.boi_token}d") == "".join(
        [f"a{processor.replace_image_token(crops, 0)}b", processor.replace_image_token(crops, 1), "c",
         processor.replace_image_token(crops, 2), "d"])
    assert "Here is the original image" in processor.replace_image_token(crops, 0)
    with fake_stack(redis_url, prompts, REPLY, images=images) as (server, cluster):
        sent = Sent(cluster)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=3, extra_body={
            "return_token_ids": True, "mm_processor_kwargs": settings})
        assert reply.prompt_token_ids == ids
        check(sent.new(), reference)
        client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=3)
        check(sent.new(), plain)
        tokenized = httpx.post(f"{server.url}/tokenize", timeout=10, json={
            "messages": messages, "mm_processor_kwargs": settings})
        assert tokenized.status_code == 200, tokenized.text
        assert tokenized.json()["tokens"] == ids
        # Too many crops in all; a message's text holding the placeholder.
        _refusal(httpx.post(f"{server.url}{CHAT}", timeout=10, json={
            "messages": [{"role": "user", "content": [_part(_data_url(_image(37, 16, 1300)))] * 4}],  # 20 crops each
            "mm_processor_kwargs": {**PAN_AND_SCAN, "pan_and_scan_max_num_crops": 20}}),
            "messages.0.content.3.image_url", "more than 64 images")
        _refusal(httpx.post(f"{server.url}{CHAT}", timeout=10, json={
            "messages": [{"role": "user", "content": [_text("w3 <start_of_image>"), _part(_data_url(pictures[0]))]}],
            "mm_processor_kwargs": settings}), "messages", "placed 2 image token(s) for 1 image(s)")
        _refusal(httpx.post(f"{server.url}{CHAT}", timeout=10, json={
            "messages": messages, "mm_processor_kwargs": {"pan_and_scan_min_ratio_to_activate": 0}}),
            "mm_processor_kwargs.pan_and_scan_min_ratio_to_activate", "must be a positive number")
    # In the folder's image processor: every request's, unless it turns it off.
    spec_file = folder / "preprocessor_config.json"
    spec_file.write_text(json.dumps({**json.loads(spec_file.read_text()), **settings}))
    images = ModelImages.from_model_dir(folder, prompts.tokenizer)
    with fake_stack(redis_url, prompts, REPLY, images=images) as (server, cluster):
        sent = Sent(cluster)
        for extra, expected in (({}, reference), ({"mm_processor_kwargs": {"do_pan_and_scan": False}}, plain)):
            response = httpx.post(f"{server.url}{CHAT}", timeout=10, json={
                "messages": messages, "max_tokens": 2, **extra})
            assert response.status_code == 200, response.text
            check(sent.new(), expected)
