"""An image-text model's images through the engine (Gemma 3, InternVL, LLaVA with a CLIP or a Pixtral tower,
Mistral 3, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, SmolVLM, LLaVA-NeXT; Idefics3's features): greedy
output equals transformers' ``generate`` with the same pixels, whatever the chunks cut, what the prefix cache
holds, a preemption, or a hand-off from prefill to decode; the blocks an image reaches are hashed under it; bad
image inputs are refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from common.engine.engine import LLMEngine
from common.engine.request import RequestStatus
from common.engine.scheduler import Scheduler
from common.protocol import ImageInput, image_digest
from common.sampling_params import SamplingParams
from tests.engine.test_disaggregated_lifecycle import _drain, hand_over
from tests.engine.tiny_models import (
    GEMMA3_IMAGE_SIDE,
    GEMMA3_TOKENS,
    IDEFICS3_TILE,
    IDEFICS3_TOKENS,
    IMAGE_TOKENS,
    INTERNVL_TILE,
    INTERNVL_TOKENS,
    LLAVA_IMAGE_SIDE,
    LLAVA_IMAGE_TOKENS,
    LLAVA_TOKENS,
    QWEN_VL_PATCH,
    QWEN_VL_TOKENS,
    expand_gemma3_tokens,
    expand_idefics3_tokens,
    expand_image_tokens,
    expand_internvl_tokens,
    expand_qwen_vl_tokens,
    gemma3_image_checkpoint,
    gemma3_pixels,
    hf_model,
    idefics3_checkpoint,
    idefics3_pixels,
    image_pixels,
    image_text_checkpoint,
    internvl_checkpoint,
    internvl_pixels,
    llava_checkpoint,
    llava_next_checkpoint,
    llava_next_pixels,
    llava_onevision_checkpoint,
    llava_onevision_sample_pixels,
    llava_pixels,
    prompt_token_ids,
    qwen_vl_checkpoint,
    qwen_vl_one_frame,
    qwen_vl_pixels,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
IMG = IMAGE_TOKENS["[IMG]"]


FAMILIES = ("gemma3", "internvl", "llava", "llava_pixtral", "llava_next", "mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
            "qwen3_vl_moe", "smolvlm")


def _drain_outputs(engine: LLMEngine) -> list[Any]:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "mistral3":
        return image_text_checkpoint(folder)
    if request.param == "gemma3":
        return gemma3_image_checkpoint(folder)
    if request.param == "internvl":
        return internvl_checkpoint(folder)
    if request.param == "llava_next":
        return llava_next_checkpoint(folder)
    if request.param == "llava_onevision":
        return llava_onevision_checkpoint(folder)
    if request.param in ("smolvlm", "idefics3"):
        return idefics3_checkpoint(folder, request.param)
    if request.param.startswith("llava"):
        return llava_checkpoint(folder, "pixtral" if request.param == "llava_pixtral" else "clip")
    return qwen_vl_checkpoint(folder, model_type=request.param)


def _qwen_patch(folder: Path) -> int | None:
    """A Qwen-VL checkpoint's patch size; None for another model."""
    return QWEN_VL_PATCH.get(json.loads((folder / "config.json").read_text())["model_type"])


def _qwen(folder: Path) -> bool:
    return _qwen_patch(folder) is not None


def _gemma(folder: Path) -> bool:
    return json.loads((folder / "config.json").read_text())["model_type"] == "gemma3"


def _internvl(folder: Path) -> bool:
    return json.loads((folder / "config.json").read_text())["model_type"] == "internvl"


def _tiled(folder: Path) -> bool:
    """A SmolVLM or Idefics3 checkpoint (images in tiles)."""
    return json.loads((folder / "config.json").read_text())["model_type"] in ("smolvlm", "idefics3")


def _next(folder: Path) -> bool:
    """A LLaVA-NeXT or LLaVA-OneVision checkpoint (images in a grid of tiles by their size)."""
    return json.loads((folder / "config.json").read_text())["model_type"] in ("llava_next", "llava_onevision")


def _clip(folder: Path) -> bool:
    """A LLaVA checkpoint with a CLIP tower (one with a Pixtral tower takes Pixtral's images, as Mistral 3)."""
    config = json.loads((folder / "config.json").read_text())
    return config["model_type"] == "llava" and config["vision_config"]["model_type"] == "clip_vision_model"


def _image(seed: int, height: int, width: int):  # type: ignore[no-untyped-def]
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def _request(folder: Path, seeds: tuple[int, ...], sizes: tuple[tuple[int, int], ...], text_seed: int = 1
             ) -> tuple[list[int], list[ImageInput], list[torch.Tensor]]:
    """A prompt of text, an image's placeholder per image (Pixtral's ``[IMG]``, Qwen's ``<|vision_start|>
    <|image_pad|><|vision_end|>``) and text between and after, expanded as the model's processor expands it; its
    images as the router sends them (Pixtral's pixels, Qwen's patches), and those."""
    qwen, gemma, clip, tiled, grid = _qwen(folder), _gemma(folder), _clip(folder), _tiled(folder), _next(folder)
    internvl = _internvl(folder)
    special = min((QWEN_VL_TOKENS if qwen else GEMMA3_TOKENS if gemma else LLAVA_TOKENS if clip or grid else
                   IDEFICS3_TOKENS if tiled else INTERNVL_TOKENS if internvl else IMAGE_TOKENS).values())
    words = prompt_token_ids(9 * (len(seeds) + 1), seed=text_seed)
    words = [w if w < special else 3 for w in words]  # no image token among the words
    placeholder = ([QWEN_VL_TOKENS["<|vision_start|>"], QWEN_VL_TOKENS["<|image_pad|>"], QWEN_VL_TOKENS["<|vision_end|>"]]
                   if qwen else [GEMMA3_TOKENS["<start_of_image>"]] if gemma else [LLAVA_TOKENS["<image>"]] if clip
                   or grid else [IDEFICS3_TOKENS["<image>"]] if tiled else [INTERNVL_TOKENS["<IMG_CONTEXT>"]] if internvl
                   else [IMG])
    prompt = words[:9]
    for k in range(len(seeds)):
        prompt += [*placeholder, *words[9 * (k + 1):9 * (k + 2)]]
    images = [_image(seed, *size) for seed, size in zip(seeds, sizes, strict=True)]
    # LLaVA-OneVision's prompt of several images: each its whole-image tile alone, as one sample of them
    whole = grid and len(images) > 1 and json.loads((folder / "config.json").read_text())["model_type"] == "llava_onevision"
    if grid:  # LLaVA-NeXT's processor: the one <image> repeated, once per feature of the image's grid
        processed = (llava_onevision_sample_pixels(folder, images) if whole
                     else [llava_next_pixels(folder, image) for image in images])
        pixels = [(p, h, w) for p, h, w, _ in processed]
        counts = iter([n for *_, n in processed])
        ids, spans = [], []
        for token in prompt:
            if token == LLAVA_TOKENS["<image>"]:
                count = next(counts)
                spans.append((len(ids), count))
                ids += [token] * count
            else:
                ids.append(token)
    elif tiled:  # transformers' processor's text for each image's grid of tiles
        pixels = [idefics3_pixels(folder, image) for image in images]
        grids = [(0, 0) if (h, w) == (IDEFICS3_TILE, IDEFICS3_TILE) else (h // IDEFICS3_TILE, w // IDEFICS3_TILE)
                 for _, h, w in pixels]
        ids, spans = expand_idefics3_tokens(folder, prompt, grids)
    elif internvl:  # a column of tiles
        pixels = [(p, len(p) * INTERNVL_TILE, INTERNVL_TILE) for p in (internvl_pixels(folder, i) for i in images)]
        ids, spans = expand_internvl_tokens(prompt, [len(p) for p, _, _ in pixels])
    elif gemma:
        pixels = [(gemma3_pixels(folder, image), GEMMA3_IMAGE_SIDE, GEMMA3_IMAGE_SIDE) for image in images]
        ids, spans = expand_gemma3_tokens(prompt, len(images))
    elif clip:  # LLaVA's processor: the one <image> repeated, once per feature
        pixels = [(llava_pixels(folder, image), LLAVA_IMAGE_SIDE, LLAVA_IMAGE_SIDE) for image in images]
        ids, spans = [], []
        for token in prompt:
            if token == LLAVA_TOKENS["<image>"]:
                spans.append((len(ids), LLAVA_IMAGE_TOKENS))
                ids += [token] * LLAVA_IMAGE_TOKENS
            else:
                ids.append(token)
    elif qwen:
        processed = [qwen_vl_pixels(folder, image) for image in images]
        ids, spans = expand_qwen_vl_tokens(prompt, [grid for _, grid in processed])
        patch = _qwen_patch(folder) or 0
        pixels = [(p, patch * h, patch * w) for p, (_, h, w) in processed]
    else:
        pixels = [image_pixels(folder, image) for image in images]
        ids, spans = expand_image_tokens(prompt, [(h, w) for _, h, w in pixels])
    sent = [(qwen_vl_one_frame(p) if qwen else p).numpy().tobytes() for p, _, _ in pixels]  # Qwen's: one frame
    inputs = [ImageInput(offset=o, length=n, height=h, width=w, digest=image_digest(data, h, w), pixel_values=data,
                         whole_image_only=whole) for (o, n), (_, h, w), data in zip(spans, pixels, sent, strict=True)]
    return ids, inputs, [p for p, _, _ in pixels]


def _hf_inputs(folder: Path, ids: list[int], images: list[ImageInput], pixels: list[torch.Tensor],
               image_aware: bool = True) -> dict[str, Any]:
    """The images as transformers' processor hands them over: Pixtral's padded into one batch with their sizes,
    Qwen's patches one after another with their grids and the image tokens marked (``mm_token_type_ids``, from
    which transformers computes M-RoPE's positions; ``image_aware`` False: every position the token's index
    instead), Gemma 3's in one batch with the image tokens marked (``token_type_ids``, from which transformers
    masks them to attend to each other both ways; ``image_aware`` False: causally)."""
    if _clip(folder):
        return {"pixel_values": torch.stack(pixels)}
    if _tiled(folder):  # every image's tiles in one row of the batch
        return {"pixel_values": torch.cat(pixels)[None]}
    if _internvl(folder):  # every image's tiles, one after another
        return {"pixel_values": torch.cat(pixels)}
    if _next(folder):  # a row of the batch per image, its tiles padded to the most tiles, its size as sent
        batch = torch.zeros(len(pixels), max(len(p) for p in pixels), *pixels[0].shape[1:])
        for k, p in enumerate(pixels):
            batch[k, :len(p)] = p
        kwargs = {"pixel_values": batch, "image_sizes": torch.tensor([[i.height, i.width] for i in images])}
        if images[0].whole_image_only:  # LLaVA-OneVision's sample of several
            kwargs["batch_num_images"] = torch.tensor([len(images)])
        return kwargs
    if _gemma(folder):
        kwargs = {"pixel_values": torch.stack(pixels)}
        if image_aware:
            kwargs["token_type_ids"] = torch.tensor([[int(t == GEMMA3_TOKENS["<image_soft_token>"]) for t in ids]])
        return kwargs
    patch = _qwen_patch(folder)
    if patch is not None:
        kwargs = {"pixel_values": torch.cat(pixels),
                  "image_grid_thw": torch.tensor([[1, i.height // patch, i.width // patch] for i in images])}
        kwargs["mm_token_type_ids"] = torch.tensor([[int(t == QWEN_VL_TOKENS["<|image_pad|>"]) for t in ids]])
        if not image_aware:
            kwargs["position_ids"] = torch.arange(len(ids)).view(1, 1, -1).expand(3, 1, -1)
        return kwargs
    height, width = max(i.height for i in images), max(i.width for i in images)
    batch = torch.zeros(len(images), 3, height, width)
    for k, p in enumerate(pixels):
        batch[k, :, :p.shape[1], :p.shape[2]] = p
    return {"pixel_values": batch, "image_sizes": torch.tensor([[i.height, i.width] for i in images])}


def _hf_greedy(folder: Path, ids: list[int], images: list[ImageInput], pixels: list[torch.Tensor]) -> list[int]:
    """transformers' ``generate`` (greedy, EOS ignored) with the images."""
    with torch.inference_mode():
        out = hf_model(folder).generate(torch.tensor([ids]), **_hf_inputs(folder, ids, images, pixels),
                                        max_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=0,
                                        eos_token_id=None)
    return [int(t) for t in out[0, len(ids):]]


def _hf_logprobs(folder: Path, ids: list[int], images: list[ImageInput], pixels: list[torch.Tensor],
                 image_aware: bool = True) -> torch.Tensor:
    """transformers' log-probabilities ``[len(ids), vocab]`` over the prompt with the images."""
    with torch.inference_mode():
        logits = hf_model(folder)(torch.tensor([ids]), **_hf_inputs(folder, ids, images, pixels, image_aware)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _engine(engine_factory: Any, folder: Path, **overrides: object) -> LLMEngine:
    """An engine on ``folder`` whose blocks are all checked back after the test (``engine_factory``); prompts in
    chunks of 7 tokens (Gemma 3's images whole: each is one chunk of up to 20 tokens)."""
    chunks = {"max_num_batched_tokens": 20, "long_prefill_token_threshold": 7} if _gemma(folder) else {
        "max_num_batched_tokens": 7}
    config: dict[str, object] = {"model": str(folder), "block_size": 8, "num_blocks": 64, **chunks,
                                 "device": "cpu", "dtype": "float32"}
    return engine_factory(**{**config, **overrides})  # type: ignore[no-any-return]


def _check_prompt_logprobs(engine: LLMEngine, folder: Path, ids: list[int], images: list[ImageInput],
                           pixels: list[torch.Tensor], request_id: str = "t") -> None:
    """The engine's prompt log-probabilities of ``ids`` with ``images`` within 1e-4 of transformers' at every
    position."""
    reference = _hf_logprobs(folder, ids, images, pixels)
    engine.add_request(request_id, ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                       images=images)
    [out] = [o for o in _drain_outputs(engine) if o.prompt_logprobs]
    got = [p.logprob for p in out.prompt_logprobs[1:]]
    want = [float(reference[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_images_equal_transformers_through_chunks_cache_and_preemption(folder: Path, engine_factory: Any) -> None:
    """Two images of different sizes in one prompt, chunks of 7 tokens (cutting through both), beside a request of
    the same words with other images; then both again from the prefix cache; then preempted part way."""
    ids, images, pixels = _request(folder, (1, 2), ((100, 180), (140, 80)))
    other_ids, other_images, other_pixels = _request(folder, (3, 4), ((100, 180), (140, 80)))
    assert other_ids == ids and other_images[0].digest != images[0].digest  # the same tokens, other pixels
    expected = _hf_greedy(folder, ids, images, pixels)
    other_expected = _hf_greedy(folder, other_ids, other_images, other_pixels)
    # The prompt's log-probabilities, from the engine's prompt logprobs, equal transformers' at every position
    # (where a tiny random model's greedy tokens may not tell two images apart, these do).
    reference = _hf_logprobs(folder, ids, images, pixels)
    assert (reference - _hf_logprobs(folder, other_ids, other_images, other_pixels)).abs().max() > 1e-2
    if _qwen(folder) or _gemma(folder):  # as do the three positions M-RoPE gives them, and Gemma's mask both ways
        assert (reference - _hf_logprobs(folder, ids, images, pixels, image_aware=False)).abs().max() > 1e-2
    scoring = _engine(engine_factory, folder)
    scoring.add_request("s", ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), images=images)
    [out] = [o for o in _drain_outputs(scoring) if o.prompt_logprobs]
    got = [p.logprob for p in out.prompt_logprobs[1:]]
    want = [float(reference[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    engine = _engine(engine_factory, folder)
    engine.add_request("a", ids, GREEDY, images=images)
    engine.add_request("b", other_ids, GREEDY, images=other_images)
    assert _drain(engine) == {"a": expected, "b": other_expected}
    # Again: the blocks before the first image are shared, none after it (another image, another prefix).
    engine.add_request("a2", ids, GREEDY, images=images)
    engine.add_request("b2", other_ids, GREEDY, images=other_images)
    requests = {r: engine.scheduler.requests[r] for r in ("a2", "b2")}
    first_image_block = images[0].offset // 8
    assert requests["a2"].block_hashes[:first_image_block] == requests["b2"].block_hashes[:first_image_block]
    assert not set(requests["a2"].block_hashes[first_image_block:]) & set(requests["b2"].block_hashes)
    assert _drain(engine) == {"a2": expected, "b2": other_expected}
    assert requests["a2"].num_cached_tokens >= 8 * (len(ids) // 8 - 1)  # all but the last block from the cache
    # A request preempted in its prompt encodes its images again as its recompute reaches them.
    small = _engine(engine_factory, folder, num_blocks=len(ids) // 8 + 3, enable_prefix_caching=False)
    small.add_request("p", ids, GREEDY, images=images)
    small.add_request("q", other_ids, GREEDY, images=other_images)
    preempted = [small.scheduler.requests["p"], small.scheduler.requests["q"]]
    assert _drain(small) == {"p": expected, "q": other_expected}
    assert sum(r.num_preemptions for r in preempted) > 0


@pytest.mark.parametrize("folder", ["idefics3"], indirect=True)
def test_idefics3_images_of_other_grids_equal_transformers(folder: Path, engine_factory: Any) -> None:
    """Idefics3's tower and connector (SmolVLM's are their twins): a tall image split into 2 x 1 tiles and a wide
    one into 1 x 2, each with the whole image as one more; then, with the image processor's splitting turned off,
    each one tile. The prompt's log-probabilities within 1e-4 of transformers' at every position."""
    grids = [(2 * IDEFICS3_TILE, IDEFICS3_TILE), (IDEFICS3_TILE, 2 * IDEFICS3_TILE)]
    for split in (True, False):
        if not split:
            spec_file = folder / "preprocessor_config.json"
            spec_file.write_text(json.dumps({**json.loads(spec_file.read_text()), "do_image_splitting": False}))
            grids = [(IDEFICS3_TILE, IDEFICS3_TILE)] * 2
        ids, images, pixels = _request(folder, (8, 9), ((100, 20), (30, 90)))
        assert [(i.height, i.width) for i in images] == grids
        engine = _engine(engine_factory, folder)
        assert engine.runner.image_encoder is not None
        assert engine.runner.image_encoder.largest() == ((2 if split else 1) * IDEFICS3_TILE,) * 2
        _check_prompt_logprobs(engine, folder, ids, images, pixels)


@pytest.mark.parametrize("folder", ["llava_onevision"], indirect=True)
def test_llava_onevision_images_equal_transformers_alone_and_several_a_prompt(folder: Path, engine_factory: Any) -> None:
    """LLaVA-OneVision's grids (1 x 2, 2 x 1, and 2 x 2, whose features ``anyres_max_1`` resizes to fit), an image a
    prompt; then prompts of two and three images, each its whole-image tile alone (transformers' way with a sample of
    several): the prompt's log-probabilities within 1e-4 of transformers' at every position. An image in the other
    mode than its prompt's count of images is refused by name."""
    import msgspec

    engine = _engine(engine_factory, folder)
    for seed, size in ((1, (100, 180)), (2, (140, 80)), (3, (64, 64))):
        ids, images, pixels = _request(folder, (seed,), (size,))
        _check_prompt_logprobs(engine, folder, ids, images, pixels, request_id=f"r{seed}")
    encoder = engine.runner.image_encoder
    assert encoder is not None and encoder.num_features(64, 64) == 16 + 4 * 5  # 8 x 8 resized to 4 x 4, newlines
    for seeds, sizes in (((1, 2), ((50, 90), (40, 40))), ((4, 5, 6), ((30, 90), (64, 64), (90, 20)))):
        ids, images, pixels = _request(folder, seeds, sizes)
        assert all(i.whole_image_only and i.length == 16 + 1 for i in images)  # a tile's features and a newline
        _check_prompt_logprobs(engine, folder, ids, images, pixels, request_id=f"s{seeds[0]}")
    one_ids, [one], _ = _request(folder, (1,), ((50, 90),))
    for prompt, bad, words in ((ids, [*images[:-1], msgspec.structs.replace(images[-1], whole_image_only=False)],
                                "images\\[2\\]: in a prompt of 3 image\\(s\\), LLaVA-OneVision takes each as its "
                                "whole-image tile alone"),
                               (one_ids, [msgspec.structs.replace(one, whole_image_only=True)],
                                "images\\[0\\]: in a prompt of 1 image\\(s\\), LLaVA-OneVision takes each with its grid")):
        with pytest.raises(ValueError, match=words):
            engine.add_request("bad", prompt, GREEDY, images=bad)


@pytest.mark.parametrize("folder", ["gemma3"], indirect=True)
def test_an_image_attends_both_ways_through_the_triton_kernels(folder: Path, engine_factory: Any) -> None:
    """Gemma 3's key limits through the Triton prefill kernel (under the interpreter): an image of 16 tokens in one
    chunk, after a chunk of text, its prompt's log-probabilities within 1e-4 of transformers'."""
    ids, images, pixels = _request(folder, (6,), ((60, 40),))
    _check_prompt_logprobs(_engine(engine_factory, folder, kernel_backend="triton"), folder, ids, images, pixels)


@pytest.mark.parametrize("folder", ["gemma3"], indirect=True)
def test_gemma3_pan_and_scan_crops_equal_transformers(folder: Path, engine_factory: Any) -> None:
    """Gemma 3's pan and scan as the router makes it (``mm_processor_kwargs``): a wide image and its 3 crops, each an
    image of its own after the processor's text, the ids and pixels equal to transformers' ``Gemma3Processor``'s;
    through the engine, the prompt's log-probabilities within 1e-4 of transformers' model given that processor's
    output, and each token of its greedy answer the model's choice."""
    import base64
    import io

    from transformers import AutoProcessor

    from router.images import ImageRef, ModelImages
    from router.openai_models import ChatRender
    from router.tokenization import PromptProcessor

    picture = _image(9, 50, 150)
    settings = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}
    text = "w1 w2 <start_of_image> w3 w4"
    reference = AutoProcessor.from_pretrained(str(folder))(text=text, images=[picture], add_special_tokens=False,
                                                           return_tensors="pt", **settings)
    prompts = PromptProcessor.from_model_dir(folder)
    processor = ModelImages.from_model_dir(folder, prompts.tokenizer).processor
    assert processor is not None
    data = io.BytesIO()
    picture.save(data, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(data.getvalue()).decode()
    [loaded] = processor.load([ImageRef("p", url)], None, processor.options(settings))
    assert len(loaded.crops) == 3
    rendered = processor.chat_render(ChatRender(), [loaded]).image_text
    assert rendered is not None
    ids, images = processor.expand(prompts.tokenizer.encode(rendered(text), add_special_tokens=False), [loaded])
    assert ids == reference["input_ids"][0].tolist() and len(images) == 4
    pixels = list(reference["pixel_values"].float())
    assert [i.pixel_values for i in images] == [p.numpy().tobytes() for p in pixels]
    engine = _engine(engine_factory, folder)
    _check_prompt_logprobs(engine, folder, ids, images, pixels)
    engine.add_request("g", ids, GREEDY, images=images)
    # Each answer token the model's choice over the prompt and the answer before it, transformers' forward teacher
    # forced (its generate's cached steps part from its own forward by 0.016 at the fifth token on this prompt of
    # 12-token windows across 18-token images: 4.4851 against 4.4688, the engine's token the forward's).
    answer = _drain(engine)["g"]
    for k, token in enumerate(answer):
        logprobs = _hf_logprobs(folder, ids + answer[:k], images, pixels)[-1]
        assert float(logprobs[token]) > float(logprobs.max()) - 1e-4, k


@pytest.mark.parametrize("folder", ["gemma3"], indirect=True)
def test_a_prefix_hit_that_ends_inside_an_image_that_attends_both_ways(folder: Path, engine_factory: Any) -> None:
    """The same words and image, other words after it: the second request's prefix hit ends inside the image (its
    16 tokens at [10, 26), blocks of 8: a hit of 24 tokens), so its first chunk starts there and runs on to the
    image's end; its answer is still transformers'."""
    ids, images, pixels = _request(folder, (7,), ((50, 90),))
    words = prompt_token_ids(len(ids) - 27, seed=5)
    other = [*ids[:27], *(w if w < min(GEMMA3_TOKENS.values()) else 3 for w in words)]  # no image token among them
    assert images[0].offset == 9 and other[:27] == ids[:27] and other[27:] != ids[27:]
    engine = _engine(engine_factory, folder)
    engine.add_request("a", ids, GREEDY, images=images)
    _drain(engine)
    scored = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    engine.add_request("b", other, scored, images=images)
    b = engine.scheduler.requests["b"]
    outputs = [lp for o in _drain_outputs(engine) for lp in o.logprobs or ()]
    assert b.num_cached_tokens == 24  # inside the image's tokens
    # Each answer token's log-probability equals transformers' over the prompt and the answer before it (a token's
    # argmax alone may not tell a key the image's last rows missed).
    answer = [lp.token_id for lp in outputs]
    reference = _hf_logprobs(folder, [*other, *answer], images, pixels)
    want = [float(reference[len(other) - 1 + j, t]) for j, t in enumerate(answer)]
    # (Measured 5e-7; with the key limits left out for a chunk that starts inside an image, 1.2e-4.)
    assert max(abs(lp.logprob - w) for lp, w in zip(outputs, want, strict=True)) < 1e-5


@pytest.mark.parametrize("folder", ["mistral3"], indirect=True)
def test_a_vision_tower_that_raises_fails_its_request_alone(folder: Path, engine_factory: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An image whose encoding raises (a GPU out of memory, say) fails its request with an error naming it, its
    blocks back in the pool; the request beside it in the same step answers as transformers does."""
    ids, images, pixels = _request(folder, (1,), ((64, 64),))
    bad_ids, bad_images, _ = _request(folder, (2,), ((100, 180),))
    expected = _hf_greedy(folder, ids, images, pixels)
    engine = _engine(engine_factory, folder, max_num_batched_tokens=200)  # both prompts in the first step
    encoder = engine.runner.image_encoder
    assert encoder is not None
    encode = encoder.encode

    def failing(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
        if (height, width) == (bad_images[0].height, bad_images[0].width):
            raise RuntimeError("CUDA out of memory (a stand-in)")
        return encode(pixels, height, width)

    monkeypatch.setattr(encoder, "encode", failing)
    engine.add_request("good", ids, GREEDY, images=images)
    engine.add_request("bad", bad_ids, GREEDY, images=bad_images)
    first = engine.step()
    [error] = [o for o in first if o.request_id == "bad"]
    assert error.finish_reason == "error" and error.error is not None
    assert "the vision tower failed" in error.error and "a stand-in" in error.error
    assert "bad" not in engine.scheduler.requests
    outputs = first + _drain_outputs(engine)
    assert [t for o in outputs if o.request_id == "good" for t in o.new_token_ids] == expected


@pytest.mark.parametrize("folder", ["mistral3"], indirect=True)
def test_requests_that_reach_the_same_image_in_a_step_encode_it_once(folder: Path, engine_factory: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two prompts of other words around the same image in one step: the tower runs once, each answer is
    transformers'; another image beside them is encoded for itself."""
    ids, images, pixels = _request(folder, (1,), ((64, 64),))
    other_ids, other_images, other_pixels = _request(folder, (1,), ((64, 64),), text_seed=2)
    third_ids, third_images, third_pixels = _request(folder, (3,), ((64, 64),), text_seed=3)
    assert other_ids != ids and other_images[0].digest == images[0].digest != third_images[0].digest
    expected = {"a": _hf_greedy(folder, ids, images, pixels),
                "b": _hf_greedy(folder, other_ids, other_images, other_pixels),
                "c": _hf_greedy(folder, third_ids, third_images, third_pixels)}
    engine = _engine(engine_factory, folder, max_num_batched_tokens=300)  # the three prompts in the first step
    encoder = engine.runner.image_encoder
    assert encoder is not None
    calls: list[int] = []
    encode = encoder.encode

    def spy(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
        calls.append(height)
        return encode(pixels, height, width)

    monkeypatch.setattr(encoder, "encode", spy)
    engine.add_request("a", ids, GREEDY, images=images)
    engine.add_request("b", other_ids, GREEDY, images=other_images)
    engine.add_request("c", third_ids, GREEDY, images=third_images)
    assert _drain(engine) == expected
    assert len(calls) == 2


def test_a_prefill_hands_an_image_prompt_to_a_decode(folder: Path, engine_factory: Any) -> None:
    """The prefill encodes the images; the decode gets their KV under the same block hashes and goes on."""
    ids, images, pixels = _request(folder, (5,), ((64, 64),))
    expected = _hf_greedy(folder, ids, images, pixels)
    prefill, decode = _engine(engine_factory, folder), _engine(engine_factory, folder)
    prefill.add_request("r", ids, GREEDY, kv_transfer=True, images=images)
    while not (outs := prefill.step()):
        pass
    [out] = outs
    assert out.kv_handoff is not None
    handoff = decode.add_remote_request("r", ids, out.new_token_ids[0], GREEDY, images=images)
    assert handoff is not None
    hand_over(prefill, decode, out, handoff)  # under the same block hashes
    assert decode.scheduler.requests["r"].status != RequestStatus.WAITING_FOR_REMOTE_KV
    assert [out.new_token_ids[0], *_drain(decode)["r"]] == expected


@pytest.mark.parametrize("folder", ["mistral3"], indirect=True)
def test_bad_image_inputs_are_refused_by_name(folder: Path, engine_factory: Any, tmp_path: Path) -> None:
    import msgspec

    ids, images, _ = _request(folder, (1,), ((50, 90),))
    engine = _engine(engine_factory, folder)
    image = images[0]
    cases = {
        "holds 23 image tokens": (ids[:image.offset + 1] + ids[image.offset + 2:],
                                  msgspec.structs.replace(image, length=image.length - 1)),
        "bytes of pixels": (ids, msgspec.structs.replace(image, pixel_values=image.pixel_values[:-4])),
        "multiples of 16": (ids, msgspec.structs.replace(image, height=image.height - 8,
                                                          pixel_values=image.pixel_values[:-8 * image.width * 12])),
        "sides of at most 112": (ids, msgspec.structs.replace(image, height=128,
                                                               pixel_values=bytes(3 * 128 * image.width * 4))),
        "leaves the prompt": (ids[:image.offset + 5], image),
        "outside its images' spans": ([*ids, IMG], image),
        "whole_image_only is LLaVA-OneVision's": (ids, msgspec.structs.replace(image, whole_image_only=True)),
    }
    for expected, (prompt, bad) in cases.items():
        with pytest.raises(ValueError, match=expected):
            engine.add_request("bad", prompt, GREEDY, images=[bad])
    with pytest.raises(ValueError, match="overlaps"):
        engine.add_request("bad", ids, GREEDY, images=[image, image])
    assert not engine.has_unfinished_requests()
    # Gemma 3's image tokens attend to each other both ways: one run in the span, prefilled in one step.
    gemma_folder = gemma3_image_checkpoint(tmp_path / "g")
    gemma_ids, [gemma_image], _ = _request(gemma_folder, (1,), ((50, 90),))
    # The span's 16 image tokens with a word among them.
    split = [*gemma_ids[:gemma_image.offset + 2], 3, *gemma_ids[gemma_image.offset + 2:]]
    gemma = _engine(engine_factory, gemma_folder)
    with pytest.raises(ValueError, match="must be one run"):
        gemma.add_request("bad", split, GREEDY, images=[msgspec.structs.replace(gemma_image, length=19)])
    with pytest.raises(ValueError, match="images\\[0\\]: its 16 tokens attend to each other both ways"):
        _engine(engine_factory, gemma_folder, max_num_batched_tokens=15).add_request(
            "bad", gemma_ids, GREEDY, images=[gemma_image])
    assert not gemma.has_unfinished_requests()


def test_the_profiling_run_encodes_the_largest_image(folder: Path, engine_factory: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU's KV cache is sized after the largest step: with the largest image's encoding in it."""
    engine = _engine(engine_factory, folder)
    encoder = engine.runner.image_encoder
    # Pixtral's tower's reach (image_size 112); a square within Qwen's image processor's max_pixels (8 x 8 tokens);
    # Gemma's and CLIP's one size.
    patch = _qwen_patch(folder)
    # SmolVLM's: its image processor's longest side, 2 tiles; LLaVA-NeXT's: its largest grid, 2 x 2 tiles.
    side = (16 * patch if patch else GEMMA3_IMAGE_SIDE if _gemma(folder) else LLAVA_IMAGE_SIDE if _clip(folder) else
            2 * IDEFICS3_TILE if _tiled(folder) else 2 * LLAVA_IMAGE_SIDE if _next(folder) else
            INTERNVL_TILE if _internvl(folder) else 112)
    # InternVL's: a column of its most tiles, 3 and the whole image
    height = 4 * side if _internvl(folder) else side
    assert encoder is not None and encoder.largest() == (height, side)
    calls = []
    encode = encoder.encode

    def spy(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
        calls.append((tuple(pixels.shape), height, width))
        return encode(pixels, height, width)

    monkeypatch.setattr(encoder, "encode", spy)
    engine.runner.profile_activations()
    assert calls == [((encoder.pixel_count(height, side),), height, side)]
    # SmolVLM's and LLaVA-NeXT's: 2 x 2 tiles and the whole image as one more
    assert encoder.pixel_count(height, side) == (16 * 16 * 3 * patch * patch if patch else  # Qwen's: one frame
                                                 5 * 3 * (side // 2) ** 2 if _tiled(folder) or _next(folder) else
                                                 3 * height * side)


def test_a_chunk_never_ends_inside_an_image_that_attends_both_ways() -> None:
    """The scheduler's cut (Gemma 3's images, ``Request.image_groups`` [10, 26) and [40, 56)): a chunk that would
    end inside an image ends at its start; one that starts inside or at it runs to its end, past the chunk cap,
    where the step's budget allows, else waits (0)."""
    def cut(computed: int, num_new: int, budget: int = 64) -> int:
        req = SimpleNamespace(num_computed_tokens=computed, image_groups=[(10, 26), (40, 56)])
        return Scheduler._whole_images(req, num_new, budget)  # type: ignore[arg-type]

    assert cut(0, 7) == 7 and cut(0, 10) == 10  # before the first image; up to its start
    assert cut(0, 12) == 10 and cut(7, 7) == 3  # into it: cut back to its start
    assert cut(10, 7) == 16 and cut(17, 7) == 9  # from its start, or a cached part of it: to its end
    assert cut(10, 7, budget=15) == 0  # the image does not fit the budget left: it waits
    assert cut(26, 20) == 14 and cut(20, 40) == 40  # to the next image's start; past both
