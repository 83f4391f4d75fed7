"""A chat message's images, as an image-text model's engines take them (vLLM's image inputs).

A user message's ``image_url`` parts (``{"type": "image_url", "image_url": {"url": ...}}``, or the URL as a
plain string) reach the engines as processed pixels: the router decodes each image, runs the model folder's
own image processor over it (transformers' ``AutoImageProcessor``, its PIL backend), and replaces the one image
token the chat template wrote for it with the span of tokens the model's processor expands it to. Each family
(``IMAGE_FAMILIES``) is a strategy of its own (``ImageFamily``): how it loads from the folder, the pixels it
sends and the span of an image:

- Mistral 3 (``PixtralImages``): float32 ``[3, height, width]`` pixels; a row of image tokens per
  ``patch_size * spatial_merge_size`` pixels of height, each row ended by the break token, the last by the end
  token.
- Qwen2-VL and Qwen2.5-VL (``QwenVLImages``; Qwen3-VL's too, its patches of 16): one frame of the processor's patches (a still image is ``temporal_patch_size``
  equal ones), float32 ``[grid_h * grid_w, 3 * patch_size ** 2]``, with the resized image's height and width;
  one ``<|image_pad|>`` per ``merge_size`` x ``merge_size`` patches.
- LLaVA (``LlavaImages``) with a CLIP or SigLIP tower: float32 ``[3, side, side]`` pixels, every image resized and
  cropped to the tower's one size; its ``<image>`` repeated once per feature, as LLaVA's processor repeats it. With
  a Pixtral tower (Pixtral 12B's checkpoint): Mistral 3's processing.
- Gemma 3 (``Gemma3Images``): float32 ``[3, side, side]`` pixels, every image resized to the one size; its
  processor expands the template's ``<start_of_image>`` in the text, newlines around it, before it is tokenized
  (``ImageFamily.text_placeholder``), which the router does too, so the ids are its processor's. With pan and
  scan (``do_pan_and_scan``), its crops beside it, each an image of its own, after the text its processor writes
  around them.
- LLaVA-NeXT (``LlavaNextImages``): the image fitted to a grid resolution and cut in tiles of the tower's one size
  after the whole image as one, float32 ``[tiles, 3, side, side]``, with the image's size as sent; its ``<image>``
  once per feature, as LLaVA-NeXT's processor counts them.
- Idefics3 and SmolVLM (``Idefics3Images``): an image split into tiles of the tower's one size and the whole
  image as one more, float32 ``[tiles, 3, tile, tile]``; its span the text its processor writes for the grid
  (a row and column token before each tile's image tokens), tokenized alone.

A family may let the image processor's settings be set per request (vLLM's ``mm_processor_kwargs``) or for the
server (``--mm-processor-kwargs``, which a request's override): Qwen-VL's ``min_pixels`` / ``max_pixels``,
Idefics3's ``do_image_splitting``, InternVL's ``crop_to_patches`` / ``min_patches`` / ``max_patches``, Gemma
3's pan and scan (``do_pan_and_scan`` and its three bounds). Each within what the engines sized their cache for
(the folder's own bounds); any other name, or a value past them, is refused by name (``ImageFamily.OPTIONS``,
``ImageProcessor.options``). Images are processed before the prompt is rendered (``ImageProcessor.load``), since
Gemma 3's text around an image depends on its crops (``ImageProcessor.chat_render``).

Each image travels as a ``common.protocol.ImageInput``: its span, its pixels and their digest, under which the
blocks its span touches are hashed.

Images come inline (``data:image/...;base64,`` URLs) or by ``http(s)://`` URL from the hosts the operator lists
(``--allowed-media-domains``; none by default: a router that fetched whatever host a client names would reach,
from inside the deployment, what the client cannot; ``router.image_fetch``). Images
are decoded from a short list of formats, bounded in bytes and in pixels (PIL's decompression-bomb limit)
before their pixels are decoded. Decoding, processing and hashing cost milliseconds to a second per image,
so they run in worker threads of their own, never on the event loop.

The models whose images the engines implement are ``common.model.arch.IMAGE_INPUT_TYPES``; the other
image-text checkpoints (``common.model.arch.IMAGE_TEXT_TYPES``) are served as text, and their images are
refused by name, as a text model's are (``ModelImages``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import pathlib
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import numpy as np

from common.cli import json_object
from common.protocol import MAX_IMAGE_BYTES, MAX_IMAGES_PER_PROMPT, ImageInput, image_digest
from router.errors import bad_request
from router.image_fetch import ImageFetcher

if TYPE_CHECKING:
    from router.openai_models import ChatRender

logger = logging.getLogger(__name__)

# An image's encoded bytes (after base64). The request body's own limit (--max-body-bytes) usually binds first.
MAX_ENCODED_IMAGE_BYTES = 32 << 20
# The formats an image may come in (PIL's names): the common ones, not every plugin PIL has (some hand the
# bytes to other programs, or parse formats few clients send and attackers like).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Where PIL's ``Image.MAX_IMAGE_PIXELS`` is turned off (None): the decoded pixels an image may have.
FALLBACK_MAX_PIXELS = 89_478_485  # PIL's default
# vLLM's ``--limit-mm-per-prompt`` default: images per prompt.
DEFAULT_MAX_IMAGES_PER_PROMPT = 4
NO_IMAGES = "this model takes no images (it is a text model)"
IMAGE_THREADS = min(4, os.cpu_count() or 1)
# vLLM's --mm-processor-cache-gb default: GiB of processed images each router process keeps.
DEFAULT_CACHE_GB = 4.0
DEFAULT_CACHE_BYTES = int(DEFAULT_CACHE_GB * (1 << 30))


class ImagesRefused(ValueError):
    """A model folder whose images are not served (its text is): the reason, naming what is not implemented."""


class OptionRefused(ValueError):
    """An image processor's setting not taken (``mm_processor_kwargs``): the message, and the ``field`` it names."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def read_options(family: ImageFamily, kwargs: Any, where: str) -> dict[str, Any]:
    """``kwargs`` (a JSON object; None: none) as settings of ``family``'s image processor (``ImageFamily.OPTIONS``,
    ``check_options``); ``OptionRefused`` naming ``where.NAME`` for a name not taken, a value of another kind, or
    one past the model's bounds."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise OptionRefused(where, f"{where} must be an object of the image processor's settings")
    for name, value in kwargs.items():
        field = f"{where}.{name}"
        kind = family.OPTIONS.get(name)
        if kind is None:
            taken = ", ".join(family.OPTIONS) or "none"
            raise OptionRefused(field, f"{field}: this model's image processor takes no such setting here "
                                       f"(taken: {taken})")
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ok = isinstance(value, bool) if kind == BOOL else (
            isinstance(value, int) and number and value >= 1 if kind == POSITIVE_INT else number and value > 0)
        if not ok:
            raise OptionRefused(field, f"{field} must be {kind}, got {value!r}")
    refused = family.check_options(kwargs)
    if refused is not None:
        name, why = refused
        raise OptionRefused(f"{where}.{name}", f"{where}.{name}: {why}")
    return dict(kwargs)


class ImageRef(NamedTuple):
    """An image part of a request: the field it came in (``messages.{i}.content.{j}.image_url``) and its URL."""

    param: str
    url: str


class ProcessedImage(NamedTuple):
    """One image as the model's processor made it: its float32 pixels, row-major, in its family's layout
    (``ImageFamily``), the processed image's height and width in pixels, and, once ``hashed``, their digest."""

    pixel_values: bytes
    height: int
    width: int
    digest: str = ""
    whole: bool = False  # LLaVA-OneVision's whole-image tile alone (``ImageInput.whole_image_only``)
    # Gemma 3's pan and scan: crops of the image, each an image of its own beside it in the prompt
    crops: tuple[ProcessedImage, ...] = ()

    def hashed(self) -> ProcessedImage:
        """The image with its pixels' digest (``common.protocol.image_digest``), its crops' too."""
        if self.digest:
            return self
        return self._replace(digest=image_digest(self.pixel_values, self.height, self.width),
                             crops=tuple(crop.hashed() for crop in self.crops))

    @property
    def pieces(self) -> tuple[ProcessedImage, ...]:
        """What the engines take as images: the image, then its crops."""
        return (self._replace(crops=()), *self.crops) if self.crops else (self,)

    @property
    def nbytes(self) -> int:
        """Its pixels' bytes, its crops' included."""
        return len(self.pixel_values) + sum(len(crop.pixel_values) for crop in self.crops)

    def engine_input(self, offset: int, length: int) -> ImageInput:
        """The image as the engines take it, its span at ``offset``, hashed."""
        return ImageInput(offset=offset, length=length, height=self.height, width=self.width,
                          digest=self.hashed().digest, pixel_values=self.pixel_values, whole_image_only=self.whole)


class ProcessedCache:
    """Processed images by the sha256 of what they came in (a data URL, or the bytes fetched for a URL), least
    recently used first out, up to ``capacity`` bytes of pixels (vLLM's ``--mm-processor-cache-gb``): a
    conversation sends its images again with every turn, and decoding, resizing and hashing them again would cost
    each turn's first token milliseconds to a second per image. The processing is a function of those bytes (the
    router's image processor is fixed); an image refused on first sight is never kept. Shared by the image
    threads: a lock around each look-up and insertion, never around the processing."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[bytes, ProcessedImage] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> ProcessedImage | None:
        with self._lock:
            image = self._entries.get(key)
            if image is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return image

    def put(self, key: bytes, image: ProcessedImage) -> None:
        """Keep ``image`` (hashed) under ``key``, dropping the least recently used past the capacity; one larger
        than the whole capacity is not kept."""
        cost = image.nbytes
        if cost > self.capacity:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            self.size += cost - (old.nbytes if old is not None else 0)
            self._entries[key] = image
            while self.size > self.capacity:
                _, dropped = self._entries.popitem(last=False)
                self.size -= dropped.nbytes


def mm_processor_cache_gb_arg(text: str) -> float:
    """vLLM's ``--mm-processor-cache-gb``: GiB of processed images a router process keeps (0: none)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mm-processor-cache-gb must be a number of GiB, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"--mm-processor-cache-gb must be 0 or more GiB, got {text!r}")
    return value


def mm_processor_kwargs_arg(text: str) -> dict[str, Any]:
    """vLLM's ``--mm-processor-kwargs``: a JSON object of the image processor's settings for every request (a
    request's ``mm_processor_kwargs`` override them); checked against the model at start (``ImageProcessor``)."""
    try:
        return json_object(text, "--mm-processor-kwargs")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# The kinds of value an image processor's setting takes (``ImageFamily.OPTIONS``).
BOOL, POSITIVE_INT, POSITIVE_NUMBER = "a boolean", "a positive integer", "a positive number"


def _check_bounds(options: dict[str, Any], low: tuple[str, int], high: tuple[str, int]) -> tuple[str, str] | None:
    """Two settings that bound an image's size (each ``(name, the folder's value)``), as ``check_options`` refuses
    them: the upper one past the folder's (the engines' cache is sized for that), or the lower one past the upper."""
    (low_name, folder_low), (high_name, folder_high) = low, high
    top = options.get(high_name, folder_high)
    if top > folder_high:
        return high_name, (f"at most the model folder's {folder_high} (the engines' cache is sized for it; raise it "
                           "in its preprocessor_config.json)")
    if options.get(low_name, folder_low) > top:
        return low_name, f"at most {high_name} ({top})"
    return None


def limit_mm_per_prompt_arg(text: str) -> int:
    """vLLM's ``--limit-mm-per-prompt`` (a JSON object, e.g. ``{"image": 4}``): the images one prompt may hold.
    Other modalities are not served: any of them set above 0 is refused by name."""
    try:
        value = json_object(text, "--limit-mm-per-prompt")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    limit = DEFAULT_MAX_IMAGES_PER_PROMPT
    for modality, count in value.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: {modality} must be a count (an integer >= 0)")
        if modality == "image":
            if count > MAX_IMAGES_PER_PROMPT:
                raise argparse.ArgumentTypeError(
                    f"--limit-mm-per-prompt: image must be at most {MAX_IMAGES_PER_PROMPT}, got {count}")
            limit = count
        elif count:
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: {modality} inputs are not served (images only)")
    return limit


def check_image_count(images: Sequence[ImageRef], limit: int) -> None:
    """A 400 naming the first image past ``limit`` (``--limit-mm-per-prompt``)."""
    if len(images) > limit:
        raise bad_request(
            f"a prompt may hold at most {limit} image(s) (--limit-mm-per-prompt), got {len(images)}",
            param=images[limit].param,
        )


def decode_image_url(url: str, param: str) -> Any:
    """The RGB PIL image of a ``data:image/...;base64,`` URL, or a 400 naming ``param``: another URL, base64
    that is not, more than ``MAX_ENCODED_IMAGE_BYTES``, a format not in
    ``IMAGE_FORMATS``, more pixels than PIL's decompression-bomb limit, or bytes that are no image.
    Transparency is composited onto white, as transformers' ``convert_to_rgb`` (and vLLM) do."""
    return _open_image(data_url_bytes(url, param), param)


def data_url_bytes(url: str, param: str) -> bytes:
    """The encoded image of a ``data:image/...;base64,`` URL (``decode_image_url``'s refusals but those of its
    decoding)."""
    if not url.startswith("data:"):  # an http(s) URL is fetched before (``ImageFetcher``)
        raise bad_request("an image URL must be a data URL (data:image/png;base64,...) or an http(s) URL",
                          param=param)
    header, comma, payload = url[5:].partition(",")
    media_type, *options = header.split(";")
    if not comma or not media_type.lower().startswith("image/") or "base64" not in options:
        raise bad_request("an image URL must be a base64 data URL of an image (data:image/png;base64,...)",
                          param=param)
    payload = payload.strip()
    if len(payload) > (MAX_ENCODED_IMAGE_BYTES + 2) // 3 * 4:
        raise bad_request(f"an image may take at most {MAX_ENCODED_IMAGE_BYTES >> 20} MiB", param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the image's data is not valid base64", param=param) from None


def _open_image(data: bytes, param: str) -> Any:
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS or FALLBACK_MAX_PIXELS
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            # The header alone is read so far: an image's size is known before its pixels are decoded.
            if image.width * image.height > limit:
                raise Image.DecompressionBombError("too many pixels")
            return _rgb(image)
    except Image.DecompressionBombError:
        raise bad_request(f"the image has more than {limit} pixels", param=param) from None
    except Exception as exc:  # PIL's decoders raise many kinds of errors for bytes that are no image
        raise bad_request(f"the image could not be decoded ({', '.join(IMAGE_FORMATS)} are read): {exc}",
                          param=param) from None


def _rgb(image: Any) -> Any:
    """``image`` in RGB, its transparency composited onto white (transformers' ``convert_to_rgb``)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _one_token(model_dir: pathlib.Path, tokenizer: Any, token: Any, what: str) -> int:
    """The id of ``token`` where the tokenizer holds it as one token; else ``ValueError`` naming ``what``."""
    token_id = tokenizer.convert_tokens_to_ids(token) if isinstance(token, str) else None
    if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != token:
        raise ValueError(f"{model_dir}: the processor's {what} {token!r} is not one token of the tokenizer")
    return token_id


def _check_model_image_token(model_dir: pathlib.Path, config: dict[str, Any], token_id: int) -> None:
    """``ValueError`` where the model's config names another image token than the processor's."""
    for key in ("image_token_index", "image_token_id"):
        model_token = config.get(key)
        if model_token is not None:
            if model_token != token_id:
                raise ValueError(f"{model_dir}: the processor's image token is id {token_id}, the model's {key} "
                                 f"{model_token!r}")
            return


def _processor_spec(model_dir: pathlib.Path) -> dict[str, Any]:
    """The folder's ``processor_config.json`` (transformers' processor's settings), or none."""
    file = model_dir / "processor_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}  # type: ignore[no-any-return]


class ImageFamily(ABC):
    """One family's image processing (``ImageProcessor``'s strategy), loaded from the model folder: one RGB image
    into the pixels its engines' vision tower reads (``process``), and the tokens the image takes in the prompt
    (``span``) in place of the one ``placeholder_id`` the chat template writes for it.

    One image token stands for ``step`` x ``step`` processed pixels: an image's processed sides are multiples of it."""

    placeholder_id: int
    step: int
    # The placeholder's text where the family's processor replaces it in the rendered text before tokenizing (by
    # ``image_text``: the spans are then in the ids already); None where the router expands the ids.
    text_placeholder: str | None = None
    # The images one prompt may hold, where the family's way with several is not implemented.
    max_images: int | None = None
    # Whether a prompt of several images takes each as its whole-image tile alone (LLaVA-OneVision's: ``run_whole``).
    whole_when_several = False
    # The image processor's settings a request or the server may set (``mm_processor_kwargs``), by name: the kind
    # of value each takes (``BOOL``, ``POSITIVE_INT``, ``POSITIVE_NUMBER``). ``check_options`` bounds them.
    OPTIONS: dict[str, str] = {}

    @classmethod
    @abstractmethod
    def load(cls, model_dir: pathlib.Path, config: dict[str, Any], tokenizer: Any) -> ImageFamily:
        """The family's processing of the folder (its ``config.json`` read as ``config``); ``ValueError`` naming
        what does not fit the tokenizer or the model."""

    @abstractmethod
    def run(self, image: Any, options: dict[str, Any]) -> ProcessedImage:
        """One RGB image through the folder's image processor, with the settings ``options`` (checked); any
        exception for one it cannot take."""

    def check_options(self, options: dict[str, Any]) -> tuple[str, str] | None:
        """Where settings of the right kinds (``OPTIONS``) are still refused: (the name, why); None where they are
        taken."""
        return None

    @abstractmethod
    def span(self, height: int, width: int) -> list[int]:
        """The tokens an image of ``height`` x ``width`` processed pixels takes in the prompt."""

    def run_whole(self, image: Any) -> ProcessedImage:
        """One RGB image as its whole-image tile alone (``whole_when_several`` families)."""
        raise NotImplementedError

    def span_of(self, image: ProcessedImage) -> list[int]:
        """The tokens a processed image takes in the prompt."""
        return self.span(image.height, image.width)

    def image_text(self, image: ProcessedImage) -> str:
        """What replaces ``text_placeholder`` in the rendered text for a processed image (``text_placeholder``
        families)."""
        raise NotImplementedError

    def process(self, image: Any, param: str, whole: bool = False,
                options: dict[str, Any] | None = None) -> ProcessedImage:
        """``run`` with ``options`` (``whole``: ``run_whole``), or a 400 naming ``param`` for an image the processor
        cannot take (a sliver a pixel wide, an aspect ratio past its bound) or that comes out smaller than one image
        token."""
        try:
            processed = self.run_whole(image) if whole else self.run(image, options or {})
        except Exception as exc:  # an image the processor cannot size
            raise bad_request(f"the image could not be processed: {exc}", param=param) from None
        if processed.height < self.step or processed.width < self.step:
            raise bad_request(f"the image is processed to {processed.height} x {processed.width} pixels, less than "
                              f"one image token ({self.step} x {self.step})", param=param)
        return processed


class PixtralImages(ImageFamily):
    """Mistral 3's (Pixtral's processor; ``processor_config.json``: the patch size, the merge of patches, the three
    tokens of an image's span). The pixels are float32 ``[3, height, width]``; the span a row of image tokens per
    ``step`` pixels of height, each row ended by the break token, the last by the end token."""

    def __init__(self, processor: Any, step: int, image_token_id: int, break_token_id: int,
                 end_token_id: int) -> None:
        self.processor = processor
        self.step = step
        self.placeholder_id = image_token_id
        self.break_token_id = break_token_id
        self.end_token_id = end_token_id

    @classmethod
    def load(cls, model_dir: pathlib.Path, config: dict[str, Any], tokenizer: Any) -> PixtralImages:
        """``preprocessor_config.json`` and ``processor_config.json`` (the patch size and merge fall back to
        ``config.json``'s); ``ValueError`` for a token the tokenizer does not hold as one, or an image token
        other than the model's."""
        from transformers import AutoImageProcessor

        spec = _processor_spec(model_dir)
        patch_size = spec.get("patch_size", (config.get("vision_config") or {}).get("patch_size"))
        merge = spec.get("spatial_merge_size", config.get("spatial_merge_size", 1))
        if isinstance(patch_size, dict):  # {"height": p, "width": p}
            patch_size = patch_size.get("height") if patch_size.get("height") == patch_size.get("width") else None
        if not isinstance(patch_size, int) or not isinstance(merge, int) or patch_size < 1 or merge < 1:
            raise ValueError(f"{model_dir}: the processor's patch_size ({patch_size!r}) and spatial_merge_size "
                             f"({merge!r}) must be positive integers")
        ids = [_one_token(model_dir, tokenizer, spec.get(key, default), key)
               for key, default in (("image_token", "[IMG]"), ("image_break_token", "[IMG_BREAK]"),
                                    ("image_end_token", "[IMG_END]"))]
        _check_model_image_token(model_dir, config, ids[0])
        # The PIL backend whatever else is installed: the same pixels on every host, in numpy (no torch).
        processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
        return cls(processor, patch_size * merge, *ids)

    def run(self, image: Any, options: dict[str, Any]) -> ProcessedImage:
        """Resized, rescaled, normalized, its sides padded to multiples of ``step`` (the padding cut off)."""
        step = {"height": self.step, "width": self.step}
        out = self.processor(images=[image], patch_size=step, return_tensors="np")
        height, width = (int(v) for v in out["image_sizes"][0])
        pixels = np.ascontiguousarray(out["pixel_values"][0, :, :height, :width], dtype=np.float32)
        return ProcessedImage(pixels.tobytes(), height, width)

    def span(self, height: int, width: int) -> list[int]:
        rows, cols = height // self.step, width // self.step
        tokens = ([self.placeholder_id] * cols + [self.break_token_id]) * rows
        tokens[-1] = self.end_token_id
        return tokens


class QwenVLImages(ImageFamily):
    """Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's (transformers' Qwen2-VL image processor; ``preprocessor_config.json``: ``patch_size``,
    ``merge_size``, ``temporal_patch_size``, the bounds on an image's pixels). The processor's patches are
    ``[grid_h * grid_w, 3 * temporal_patch_size * patch_size ** 2]``, a still image ``temporal_patch_size`` equal
    frames of one; the pixels sent are one frame of them, float32 ``[grid_h * grid_w, 3 * patch_size ** 2]``
    (half the bytes; the engines repeat it), with ``height`` and ``width`` the resized image's (``grid_h *
    patch_size``, ``grid_w * patch_size``); the span one ``<|image_pad|>`` per ``merge_size ** 2`` patches, between
    the ``<|vision_start|>`` and ``<|vision_end|>`` the template writes around it."""

    IMAGE_TOKEN = "<|image_pad|>"
    # The bounds on an image's pixels once resized (its processor's ``size``: ``shortest_edge``, ``longest_edge``),
    # ``max_pixels`` no more than the folder's, which the engines' cache is sized for (``common.model.vision``).
    OPTIONS = {"min_pixels": POSITIVE_INT, "max_pixels": POSITIVE_INT}

    def __init__(self, processor: Any, image_token_id: int, patch_size: int, merge_size: int,
                 temporal_patch_size: int) -> None:
        self.processor = processor
        size = getattr(processor, "size", None) or {}
        self.min_pixels, self.max_pixels = int(size["shortest_edge"]), int(size["longest_edge"])
        self.placeholder_id = image_token_id
        self.patch_size = patch_size
        self.step = patch_size * merge_size
        self.frames = temporal_patch_size
        self.patch_width = 3 * temporal_patch_size * patch_size ** 2

    @classmethod
    def load(cls, model_dir: pathlib.Path, config: dict[str, Any], tokenizer: Any) -> QwenVLImages:
        """``preprocessor_config.json``; ``ValueError`` where the tokenizer does not hold ``<|image_pad|>`` as one
        token, where it is not the model's ``image_token_id``, or where the processor's patch sizes are not the
        vision tower's (``vision_config``)."""
        from transformers import AutoImageProcessor

        image_token_id = _one_token(model_dir, tokenizer, cls.IMAGE_TOKEN, "image token")
        _check_model_image_token(model_dir, config, image_token_id)
        # The PIL backend whatever else is installed: the same pixels on every host, in numpy (no torch).
        processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
        vision = config.get("vision_config") or {}
        sizes = []
        for name, model_name in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                                 ("temporal_patch_size", "temporal_patch_size")):
            value = getattr(processor, name, None)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{model_dir}: the image processor's {name} ({value!r}) must be a positive integer")
            if model_name in vision and vision[model_name] != value:
                raise ValueError(f"{model_dir}: the image processor's {name} is {value}, the vision tower's "
                                 f"{model_name} {vision[model_name]!r}")
            sizes.append(value)
        return cls(processor, image_token_id, *sizes)

    def run(self, image: Any, options: dict[str, Any]) -> ProcessedImage:
        """Resized to sides that are multiples of ``step`` (within the processor's bounds on pixels), rescaled,
        normalized, cut into patches; one of their equal frames."""
        size = {"shortest_edge": options.get("min_pixels", self.min_pixels),
                "longest_edge": options.get("max_pixels", self.max_pixels)}
        out = self.processor(images=[image], size=size, return_tensors="np")
        [(frames, rows, cols)] = (tuple(int(v) for v in grid) for grid in out["image_grid_thw"])
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        if frames != 1 or pixels.shape != (rows * cols, self.patch_width):
            raise ValueError(f"the processor made patches {pixels.shape} of grid {(frames, rows, cols)}, not one "
                             f"frame's [{rows * cols}, {self.patch_width}]")
        # Each patch's values are channel, frame, row, column: the frames of a still image are one image repeated.
        patches = pixels.reshape(rows * cols, 3, self.frames, -1)
        if not (patches == patches[:, :, :1]).all():
            raise ValueError("the processor's frames of a still image differ")
        return ProcessedImage(np.ascontiguousarray(patches[:, :, 0]).tobytes(), rows * self.patch_size,
                              cols * self.patch_size)

    def span(self, height: int, width: int) -> list[int]:
        return [self.placeholder_id] * ((height // self.step) * (width // self.step))

    def check_options(self, options: dict[str, Any]) -> tuple[str, str] | None:
        return _check_bounds(options, ("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels))


def _one_size(out: Any, side: int) -> ProcessedImage:
    """The one image an image processor's output holds, of the one size its tower takes."""
    pixels = np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)
    if pixels.shape != (3, side, side):
        raise ValueError(f"the processor made pixels {pixels.shape}, not the vision tower's [3, {side}, {side}]")
    return ProcessedImage(pixels.tobytes(), side, side)


class LlavaImages(ImageFamily):
    """LLaVA's with a CLIP or SigLIP tower (transformers' LLaVA processor: ``processor_config.json``'s
    ``patch_size``, ``num_additional_image_tokens``, ``vision_feature_select_strategy``, ``image_token``; the
    folder's image processor, CLIP's or SigLIP's). The pixels are float32 ``[3, side, side]``; the span the image
    token once per feature: ``(side / patch_size) ** 2 + num_additional_image_tokens``, less one for the ``default``
    strategy. A LLaVA checkpoint with a Pixtral tower takes Pixtral's processing (``PixtralImages``)."""

    def __init__(self, processor: Any, side: int, image_token_id: int, num_tokens: int) -> None:
        self.processor = processor
        self.step = side
        self.placeholder_id = image_token_id
        self.num_tokens = num_tokens

    @classmethod
    def load(cls, model_dir: pathlib.Path, config: dict[str, Any], tokenizer: Any) -> ImageFamily:
        """``ImagesRefused`` for a tower or strategy not implemented; ``ValueError`` where the processor's image
        token or count of them is not the model's."""
        from transformers import AutoImageProcessor

        from common.model.arch import LLAVA_TOWERS, llava_image_refusal

        vision = config.get("vision_config") or {}
        tower, strategy = vision.get("model_type"), config.get("vision_feature_select_strategy", "default")
        refusal = llava_image_refusal(tower, strategy)
        if refusal is not None:
            raise ImagesRefused(refusal)
        if tower == "pixtral":
            return PixtralImages.load(model_dir, config, tokenizer)
        spec = _processor_spec(model_dir)
        image_token = getattr(tokenizer, "image_token", None) or spec.get("image_token", "<image>")
        image_token_id = _one_token(model_dir, tokenizer, image_token, "image token")
        _check_model_image_token(model_dir, config, image_token_id)
        side, patch = vision.get("image_size", 224), vision.get("patch_size", 32)
        num_tokens = (side // patch) ** 2 + int(LLAVA_TOWERS[str(tower)]) - int(strategy == "default")
        processed = (side // spec.get("patch_size", patch)) ** 2 + spec.get("num_additional_image_tokens", 0) - int(
            spec.get("vision_feature_select_strategy") == "default")
        if processed != num_tokens:
            raise ValueError(f"{model_dir}: LLaVA's processor makes {processed} image tokens of an image, its model "
                             f"{num_tokens} features (processor_config.json's patch_size, "
                             "num_additional_image_tokens and vision_feature_select_strategy)")
        # The PIL backend whatever else is installed: the same pixels on every host, in numpy (no torch).
        processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
        return cls(processor, side, image_token_id, num_tokens)

    def run(self, image: Any, options: dict[str, Any]) -> ProcessedImage:
        """Resized (and cropped) to the tower's one size, rescaled, normalized."""
        return _one_size(self.processor(images=[image], return_tensors="np"), self.step)

    def span(self, height: int, width: int) -> list[int]:
        return [self.placeholder_id] * self.num_tokens


class LlavaNextImages(ImageFamily):
    """LLaVA-NeXT's (its image processor: the image resized and padded to the grid resolution of
    ``image_grid_pinpoints`` that fits it best, cut in tiles of the tower's one size, after the whole image resized
    to one; transformers' LLaVA-NeXT processor's count of an image's tokens, from ``processor_config.json``). The
    pixels are float32 ``[tiles, 3, side, side]``; the processed size is the image's own, from which the engines
    know its grid; the span ``<image>`` once per feature of it."""

    default_strategy = "default"  # the config's vision_feature_select_strategy where it sets none (transformers')

    def __init__(self, processor: Any, counter: Any, side: int, image_token_id: int, drop_first: bool) -> None:
        self.processor = processor
        self.counter = counter
        self.step = 1
        self.side = side
        self.placeholder_id = image_token_id
        self.drop_first = drop_first

    @classmethod
    def load(cls, model_dir: pathlib.Path, config: dict[str, Any], tokenizer: Any) -> LlavaNextImages:
        """``ImagesRefused`` for a tower or strategy not implemented; ``ValueError`` where the processor's image
        token, tile or grid is not the model's."""
        from transformers import AutoImageProcessor

        from common.model.arch import llava_next_image_refusal

        vision = config.get("vision_config") or {}
        strategy = config.get("vision_feature_select_strategy", cls.default_strategy)
        aspect = config.get("vision_aspect_ratio", "anyres_max_9")
        refusal = llava_next_image_refusal(config["model_type"], vision.get("model_type"), strategy, aspect)
        if refusal is not None:
            raise ImagesRefused(refusal)
        spec = _processor_spec(model_dir)
        image_token = getattr(tokenizer, "image_token", None) or spec.get("image_token", "<image>")
        image_token_id = _one_token(model_dir, tokenizer, image_token, "image token")
        _check_model_image_token(model_dir, config, image_token_id)
        # The PIL backend whatever else is installed: the same pixels on every host, in numpy (no torch).
        processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
        side, patch = vision.get("image_size", 224), vision.get("patch_size", 32)
        tile = dict(processor.crop_size or processor.size or {})  # OneVision's tiles are its size, uncropped
        if (tile.get("height"), tile.get("width")) != (side, side):
            raise ValueError(f"{model_dir}: the image processor's tiles {tile!r} are not the vision tower's "
                             f"image_size {side!r}")
        pinpoints = config.get("image_grid_pinpoints")
        if [list(p) for p in processor.image_grid_pinpoints] != [list(p) for p in pinpoints or ()]:
            raise ValueError(f"{model_dir}: the image processor's image_grid_pinpoints are not the model's")
        if spec.get("vision_feature_select_strategy", strategy) != strategy:
            raise ValueError(f"{model_dir}: processor_config.json's vision_feature_select_strategy is not the model's")
        counter = cls.counter_for(processor, tokenizer, spec, (side // patch) ** 2, patch, strategy, aspect)
        return cls(processor, counter, side, image_token_id, strategy == "default")

    @staticmethod
    def counter_for(processor: Any, tokenizer: Any, spec: dict[str, Any], per_tile: int, patch: int, strategy: str,
                    aspect: str) -> Any:
        """transformers' processor whose count of an image's tokens the span takes; ``ValueError`` where its
        settings (``processor_config.json``) are not the model's."""
        from transformers import LlavaNextProcessor

        if spec.get("patch_size", patch) != patch:
            raise ValueError(f"processor_config.json's patch_size {spec.get('patch_size')!r} is not the model's {patch}")
        return LlavaNextProcessor(processor, tokenizer, patch_size=patch, vision_feature_select_strategy=strategy,
                                  num_additional_image_tokens=spec.get("num_additional_image_tokens", 0))

    def run(self, image: Any, options: dict[str, Any]) -> ProcessedImage:
        """Fitted to its grid, cut in tiles after the whole image as one, rescaled, normalized; its size as sent."""
        out = self.processor(images=[image], return_tensors="np")
        height, width = (int(v) for v in out["image_sizes"][0])
        pixels = np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)
        if pixels.shape[1:] != (3, self.side, self.side):
            raise ValueError(f"the processor made pixels {pixels.shape}, not tiles of [3, {self.side}, {self.side}]")
        return ProcessedImage(pixels.tobytes(), height, width)

    def span(self, height: int, width: int) -> list[int]:
        count = self.counter._get_number_of_features(height, width, self.side, self.side) - int(self.drop_first)
        return [self.placeholder_id] * count


class LlavaOnevisionImages(LlavaNextImages):
    """LLaVA-OneVision's: LLaVA-NeXT's tiles (its image processor's), transformers' LLaVA-OneVision processor's count
    (a grid of more features than ``vision_aspect_ratio`` allows counted as resized to fit). In a prompt of several
    images each is its whole-image tile alone (padded to a square, resized), ``num_image_tokens`` and a newline's
    token, as its processor makes a sample of several."""

    default_strategy = "full"
    whole_when_several = True

    def run_whole(self, image: Any) -> ProcessedImage:
        """Padded to a square, resized to one tile, rescaled, normalized (the image processor's way with an image
        of a sample of several: it is given one more, a pixel's worth, that is dropped); its size as sent."""
        from PIL import Image

        out = self.processor(images=[[image, Image.new("RGB", (1, 1))]], return_tensors="np")
        height, width = (int(v) for v in out["image_sizes"][0])
        pixels = np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)
        if pixels.shape != (1, 3, self.side, self.side):
            raise ValueError(f"the processor made pixels {pixels.shape}, not one tile of [3, {self.side}, {self.side}]")
        return ProcessedImage(pixels.tobytes(), height, width, whole=True)

    def span_of(self, image: ProcessedImage) -> list[int]:
        if not image.whole:
            return self.span(image.height, image.width)
        return [self.placeholder_id] * (self.counter.num_image_tokens + 1 - int(self.drop_first))

    @staticmethod
    def counter_for(processor: Any, tokenizer: Any, spec: dict[str, Any], per_tile: int, patch: int, strategy: str,
                    aspect: str) -> Any:
        from transformers import LlavaOnevisionProcessor

        if spec.get("num_image_tokens", per_tile) != per_tile or spec.get("vision_aspect_ratio", aspect) != aspect:
            raise ValueError(f"processor_config.json's num_image_tokens or vision_aspect_ratio is not the model's "
                             f"({per_tile}, {aspect})")
        # Its count alone: the class's constructor wants a video processor, which needs torchvision.
        counter = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
        counter.image_processor, counter.num_image_tokens = processor, per_tile
        counter.vision_feature_select_strategy, counter.vision_aspect_ratio = strategy, aspect
        return counter


class Gemma3Images(ImageFamily):
    """Gemma 3's (transformers' Gemma 3 image processor and processor: ``preprocessor_config.json``,
    ``processor_config.json``'s ``image_seq_length``). The pixels are float32 ``[3, side, side]``, every image
    resized to the tower's one size; the span ``<start_of_image>``, ``image_seq_length`` image tokens and
    ``<end_of_image>``. Its processor writes that sequence, with two newlines on either side, in place of each
    ``<start_of_image>`` of the rendered text before tokenizing, where newlines merge with the text's own into
    one token: the router does the same (``text_placeholder``, ``image_text``).

    Pan and scan (``do_pan_and_scan``, in the folder's image processor or a request's settings): an image whose
    sides differ by ``pan_and_scan_min_ratio_to_activate`` or more is also cut into 2 to ``pan_and_scan_max_num_crops``
    crops along its longer side (none under ``pan_and_scan_min_crop_size`` pixels), each resized to the one size
    and sent as an image of its own after it (``ProcessedImage.crops``); its processor writes ``Here is the
    original image``, the image's sequence, ``and here are some crops to help you see better`` and each crop's
    sequence, a space apart, in place of the image's ``<start_of_image>``."""

    # Where the folder's image processor leaves them unset, its processor's own (transformers' Gemma3Processor).
    PAN_AND_SCAN_DEFAULTS = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                             "pan_and_scan_min_ratio_to_activate": 1.2}
    OPTIONS = {"do_pan_and_scan": BOOL, "pan_and_scan_min_crop_size": POSITIVE_INT,
               "pan_and_scan_max_num_crops": POSITIVE_INT, "pan_and_scan_min_ratio_to_activate": POSITIVE_NUMBER}

    def __init__(self, processor: Any, side: int, boi: tuple[str, int], image: tuple[str, int], eoi: tuple[str, int],
                 num_tokens: int) -> None:
        self.processor = processor
        self.step = side
        self.placeholder_id = boi[1]
        self.image_token_id = image[1]
        self.span_ids = [boi[1], *[image[1]] * num_tokens, eoi[1]]
        self.text_placeholder = boi[0]
        self.sequence = f"\n\n{boi[0]}{image[0] * num_tokens}{eoi[0]}\n\n"
        # The folder's pan and scan: whether it is on, and its bounds (``PAN_AND_SCAN_DEFAULTS`` where unset).
        self.pan_and_scan: dict[str, Any] = {"do_pan_and_scan": bool(getattr(processor, "do_pan_and_scan", False))}
        for name, default in self.PAN_AND_SCAN_DEFAULTS.items():
            value = getattr(processor, name, None)
            self.pan_and_scan[name] = default if value is None else value

    @classmethod
    def load(cls, model_dir: pathlib.Path, config: dict[str, Any], tokenizer: Any) -> Gemma3Images:
        """``preprocessor_config.json`` and ``processor_config.json``; ``ValueError`` for a token the tokenizer does
        not hold as one or that is not the model's, an ``image_seq_length`` other than the model's
        ``mm_tokens_per_image``, or a size other than the tower's."""
        from transformers import AutoImageProcessor

        tokens: list[tuple[str, int]] = []
        for name, default, key in (("boi_token", "<start_of_image>", "boi_token_index"),
                                   ("image_token", "<image_soft_token>", "image_token_index"),
                                   ("eoi_token", "<end_of_image>", "eoi_token_index")):
            text = getattr(tokenizer, name, None) or default
            token_id = _one_token(model_dir, tokenizer, text, name)
            model_id = config.get(key, config.get(key.replace("_index", "_id")))
            if model_id is not None and model_id != token_id:
                raise ValueError(f"{model_dir}: the tokenizer's {name} {text!r} is id {token_id}, the model's {key} "
                                 f"{model_id!r}")
            tokens.append((text, token_id))
        spec = _processor_spec(model_dir)
        num_tokens = spec.get("image_seq_length", 256)
        if num_tokens != config.get("mm_tokens_per_image", 256):
            raise ValueError(f"{model_dir}: the processor's image_seq_length {num_tokens!r} is not the model's "
                             f"mm_tokens_per_image {config.get('mm_tokens_per_image', 256)!r}")
        # The PIL backend whatever else is installed: the same pixels on every host, in numpy (no torch).
        processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
        size = getattr(processor, "size", None) or {}
        side = (config.get("vision_config") or {}).get("image_size", 224)
        if (size.get("height"), size.get("width")) != (side, side):
            raise ValueError(f"{model_dir}: the image processor's size {dict(size)!r} is not the vision tower's "
                             f"image_size {side!r}")
        boi, image, eoi = tokens
        return cls(processor, side, boi, image, eoi, num_tokens)

    def run(self, image: Any, options: dict[str, Any]) -> ProcessedImage:
        """Resized to the one size, rescaled, normalized; with pan and scan, its crops too, each so."""
        out = self.processor(images=[image], return_tensors="np", **{**self.pan_and_scan, **options})
        [num_crops] = (int(n) for n in out["num_crops"])
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        side = self.step
        if pixels.shape != (1 + num_crops, 3, side, side):
            raise ValueError(f"the processor made pixels {pixels.shape}, not the image and {num_crops} crop(s) of "
                             f"[3, {side}, {side}]")
        first, *crops = (ProcessedImage(one.tobytes(), side, side) for one in pixels)
        return first._replace(crops=tuple(crops))

    def span(self, height: int, width: int) -> list[int]:
        return list(self.span_ids)

    def image_text(self, image: ProcessedImage) -> str:
        if not image.crops:
            return self.sequence
        return (f"Here is the original image {self.sequence} and here are some crops to help you see better "
                + " ".join([self.sequence] * len(image.crops)))


class Idefics3Images(ImageFamily):
    """Idefics3's and SmolVLM's (their image processor, which splits an image into tiles of the tower's one size,
    and ``processor_config.json``'s ``image_seq_len``). The pixels are float32 ``[tiles, 3, tile, tile]``: a split
    image's tiles row by row, then the whole image resized to one tile; an image of one tile that tile alone. Its
    processed size is its grid (``rows * tile`` x ``columns * tile``; one tile: ``tile`` x ``tile``). The span is
    the text its processor writes in place of ``<image>`` before tokenizing: per tile ``<fake_token_around_image>``,
    ``<row_R_col_C>`` and ``image_seq_len`` image tokens, a newline after each row, then a newline,
    ``<fake_token_around_image><global-img>``, the whole image's tokens and ``<fake_token_around_image>`` (one
    tile: the last part alone, without the newline), tokenized alone. That is the processor's tokenization of the
    prompt where the special tokens at both ends keep it from merging with the text around it, which ``load``
    checks against the tokenizer."""

    # Off: every image resized to one tile. On only where the folder's processor splits (the engines' cache is
    # sized for its grids, ``common.model.vision``).
    OPTIONS = {"do_image_splitting": BOOL}

    def __init__(self, processor: Any, tokenizer: Any, side: int, tokens: dict[str, str], num_tokens: int) -> None:
        self.processor = processor
        self.tokenizer = tokenizer
        self.step = side
        self.tokens = tokens
        self.num_tokens = num_tokens
        self.placeholder_id = tokenizer.convert_tokens_to_ids(tokens["image_token"])
        self._spans: dict[tuple[int, int], list[int]] = {}

    @classmethod
    def load(cls, model_dir: pathlib.Path, config: dict[str, Any], tokenizer: Any) -> Idefics3Images:
        """``ValueError`` for a token the tokenizer does not hold as one or that is not the model's, a tile or an
        ``image_seq_len`` other than the model's; ``ImagesRefused`` where the tokenizer would merge an image's text
        with the text around it."""
        from transformers import AutoImageProcessor

        tokens = {name: getattr(tokenizer, name, None) or default for name, default in (
            ("image_token", "<image>"), ("fake_image_token", "<fake_token_around_image>"),
            ("global_image_token", "<global-img>"))}
        for name, text in tokens.items():
            _one_token(model_dir, tokenizer, text, name)
        _check_model_image_token(model_dir, config, tokenizer.convert_tokens_to_ids(tokens["image_token"]))
        vision = config.get("vision_config") or {}
        side, patch = vision.get("image_size", 224), vision.get("patch_size", 32)
        num_tokens = (side // patch) ** 2 // config.get("scale_factor", 2) ** 2
        spec = _processor_spec(model_dir)
        if spec.get("image_seq_len", 169) != num_tokens:
            raise ValueError(f"{model_dir}: the processor's image_seq_len {spec.get('image_seq_len', 169)!r} is not "
                             f"the model's {num_tokens} features of a tile")
        # The PIL backend whatever else is installed: the same pixels on every host, in numpy (no torch).
        processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
        tile = (getattr(processor, "max_image_size", None) or {}).get("longest_edge")
        if tile != side:
            raise ValueError(f"{model_dir}: the image processor's max_image_size {tile!r} is not the vision tower's "
                             f"image_size {side!r}")
        family = cls(processor, tokenizer, side, tokens, num_tokens)
        grid = 1
        if processor.do_image_splitting:
            grid = -(-min(int(processor.size["longest_edge"]), 4096) // side)
        for row in range(1, grid + 1):
            for col in range(1, grid + 1):
                _one_token(model_dir, tokenizer, f"<row_{row}_col_{col}>", "row and column token")
        family.check_alone(model_dir, side, min(grid, 2) * side)
        return family

    def check_alone(self, model_dir: pathlib.Path, height: int, width: int) -> None:
        """``_check_alone`` for an image of this processed size."""
        _check_alone(model_dir, self.tokenizer, self.text(height, width), self.span(height, width))

    def text(self, height: int, width: int) -> str:
        """What the processor writes in place of ``<image>`` for an image of this processed size."""
        image, fake, whole = self.tokens["image_token"], self.tokens["fake_image_token"], self.tokens[
            "global_image_token"]
        tile_tokens = image * self.num_tokens
        last = f"{fake}{whole}{tile_tokens}{fake}"
        if (height, width) == (self.step, self.step):
            return last
        rows = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>{tile_tokens}" for c in range(width // self.step))
                       + "\n" for r in range(height // self.step))
        return f"{rows}\n{last}"

    def run(self, image: Any, options: dict[str, Any]) -> ProcessedImage:
        """Resized, split into tiles with the whole image as one more (or one tile), rescaled, normalized."""
        out = self.processor(images=[image], return_tensors="np", return_row_col_info=True,
                             do_image_splitting=options.get("do_image_splitting", self.processor.do_image_splitting))
        rows, cols, side = int(out["rows"][0][0]), int(out["cols"][0][0]), self.step
        pixels = np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)
        tiles = rows * cols + 1 if rows else 1
        if pixels.shape != (tiles, 3, side, side):
            raise ValueError(f"the processor made pixels {pixels.shape}, not {tiles} tiles of [3, {side}, {side}]")
        return ProcessedImage(pixels.tobytes(), max(rows, 1) * side, max(cols, 1) * side)

    def check_options(self, options: dict[str, Any]) -> tuple[str, str] | None:
        if options.get("do_image_splitting") and not self.processor.do_image_splitting:
            return "do_image_splitting", ("the model folder's image processor does not split images (the engines' "
                                          "cache is sized for one tile)")
        return None

    def span(self, height: int, width: int) -> list[int]:
        grid = (height // self.step, width // self.step)
        span = self._spans.get(grid)
        if span is None:
            span = self._spans[grid] = self.tokenizer.encode(self.text(height, width), add_special_tokens=False)
        return list(span)


def _check_alone(model_dir: pathlib.Path, tokenizer: Any, text: str, span: list[int]) -> None:
    """``ImagesRefused`` where the tokenizer's ids of a prompt with an image's ``text`` in it are not the text
    before, the image's ``span`` and the text after, each tokenized alone (an added token that strips the newlines
    beside it, say): the processor tokenizes the text, the router puts the span in place of the placeholder."""
    encode = tokenizer.encode
    for before, after in ((":", "\n"), ("w ", " w"), ("\n", "\n\n")):
        whole = encode(before + text + after, add_special_tokens=False)
        if whole != encode(before, add_special_tokens=False) + span + encode(after, add_special_tokens=False):
            raise ImagesRefused(f"{model_dir}: the tokenizer merges an image's text with the text around it "
                                "(its image tokens strip or join their neighbours): images are not served")


class InternVLImages(ImageFamily):
    """InternVL's (InternVL 3 and 3.5 in transformers' form: GOT-OCR2's image processor, run with
    ``crop_to_patches`` as InternVL's processor runs it; ``processor_config.json``'s ``image_seq_length``). The
    pixels are float32 ``[tiles, 3, tile, tile]``: the image's grid of tiles, then (where there are several) the
    whole image resized to one; its processed size a column of them, ``tiles * tile`` x ``tile``. The span is what
    its processor writes in place of each ``<IMG_CONTEXT>`` the chat template writes for an image: ``<img>``,
    ``image_seq_length`` context tokens per tile and ``</img>``, each one token, kept apart from the text around
    them (``load`` checks that against the tokenizer)."""

    # The grid's bounds in tiles (``max_patches`` no more than the folder's, which the engines' cache is sized for:
    # ``common.model.vision``); ``crop_to_patches`` off: the whole image as one tile.
    OPTIONS = {"crop_to_patches": BOOL, "min_patches": POSITIVE_INT, "max_patches": POSITIVE_INT}

    def __init__(self, processor: Any, side: int, start_id: int, context_id: int, end_id: int, num_tokens: int) -> None:
        self.processor = processor
        self.min_patches, self.max_patches = int(processor.min_patches), int(processor.max_patches)
        self.step = side
        self.placeholder_id = context_id
        self.ids = (start_id, context_id, end_id)
        self.num_tokens = num_tokens

    @classmethod
    def load(cls, model_dir: pathlib.Path, config: dict[str, Any], tokenizer: Any) -> InternVLImages:
        """``ValueError`` for a token the tokenizer does not hold as one or that is not the model's, a tile or an
        ``image_seq_length`` other than the model's; ``ImagesRefused`` for a strategy or layout not implemented, or
        where the tokenizer would merge an image's tokens with the text around them."""
        from transformers import AutoImageProcessor

        from common.model.arch import square_side

        tokens = [getattr(tokenizer, name, None) or default for name, default in (
            ("start_image_token", "<img>"), ("context_image_token", "<IMG_CONTEXT>"), ("end_image_token", "</img>"))]
        start_id, context_id, end_id = (_one_token(model_dir, tokenizer, text, what) for text, what in zip(
            tokens, ("start image token", "image token", "end image token"), strict=True))
        _check_model_image_token(model_dir, config, context_id)
        vision = config.get("vision_config") or {}
        side, patch = (square_side(vision.get(key, default), key, ImagesRefused)
                       for key, default in (("image_size", 448), ("patch_size", 14)))
        ratio = config.get("downsample_ratio", 0.5)
        strategy = config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ImagesRefused(f"image input with vision_feature_select_strategy {strategy!r} is not implemented "
                                "(default, full)")
        num_tokens = int((side // patch) ** 2 * ratio ** 2)
        spec = _processor_spec(model_dir)
        if spec.get("image_seq_length", 256) != num_tokens:
            raise ValueError(f"{model_dir}: the processor's image_seq_length {spec.get('image_seq_length', 256)!r} "
                             f"is not the model's {num_tokens} features of a tile")
        # The PIL backend whatever else is installed: the same pixels on every host, in numpy (no torch).
        processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
        size = getattr(processor, "size", None) or {}
        if (size.get("height"), size.get("width")) != (side, side):
            raise ValueError(f"{model_dir}: the image processor's size {dict(size)!r} is not the vision tower's "
                             f"image_size {side!r}")
        family = cls(processor, side, start_id, context_id, end_id, num_tokens)
        _check_alone(model_dir, tokenizer, tokens[0] + tokens[1] * 2 * num_tokens + tokens[2], family.span(2 * side, side))
        return family

    def run(self, image: Any, options: dict[str, Any]) -> ProcessedImage:
        """Cut into its grid of tiles (and the whole image as one more where there are several), rescaled,
        normalized."""
        out = self.processor(images=[image], crop_to_patches=options.get("crop_to_patches", True),
                             min_patches=options.get("min_patches", self.min_patches),
                             max_patches=options.get("max_patches", self.max_patches), return_tensors="np")
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        tiles, side = int(out["num_patches"][0]), self.step
        if pixels.shape != (tiles, 3, side, side):
            raise ValueError(f"the processor made pixels {pixels.shape}, not {tiles} tiles of [3, {side}, {side}]")
        return ProcessedImage(pixels.tobytes(), tiles * side, side)

    def check_options(self, options: dict[str, Any]) -> tuple[str, str] | None:
        return _check_bounds(options, ("min_patches", self.min_patches), ("max_patches", self.max_patches))

    def span(self, height: int, width: int) -> list[int]:
        start, context, end = self.ids
        return [start, *[context] * (self.num_tokens * (height // self.step)), end]


# The families whose images the router processes, by model type (each of ``common.model.arch.IMAGE_INPUT_TYPES``).
IMAGE_FAMILIES: dict[str, type[ImageFamily]] = {
    "gemma3": Gemma3Images, "idefics3": Idefics3Images, "internvl": InternVLImages, "llava": LlavaImages,
    "llava_next": LlavaNextImages,
    "llava_onevision": LlavaOnevisionImages, "mistral3": PixtralImages,
    "qwen2_vl": QwenVLImages, "qwen2_5_vl": QwenVLImages, "qwen3_vl": QwenVLImages, "qwen3_vl_moe": QwenVLImages, "smolvlm": Idefics3Images,
}


class ImageProcessor:
    """The served model's image processing: its family's (``family``), run in threads of its own, and what
    every family shares: the placeholders the template wrote checked, each replaced by its image's span."""

    def __init__(self, family: ImageFamily, num_threads: int = IMAGE_THREADS, fetcher: ImageFetcher | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, options: dict[str, Any] | None = None) -> None:
        self.family = family
        # --mm-processor-kwargs: every request's settings, under its own (``options``); ``OptionRefused`` at start.
        self.defaults = read_options(family, options, "--mm-processor-kwargs")
        # Images by URL, from the hosts --allowed-media-domains lists (none by default: each refused by name).
        self.fetcher = fetcher or ImageFetcher(())
        self.cache = ProcessedCache(cache_bytes)  # --mm-processor-cache-gb
        # Threads of their own: an image's seconds never queue the tokenizer's work or the default executor's.
        self._pool = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="images")

    @classmethod
    def from_model_dir(cls, model_dir: pathlib.Path, tokenizer: Any, fetcher: ImageFetcher | None = None,
                       cache_bytes: int = DEFAULT_CACHE_BYTES, options: dict[str, Any] | None = None
                       ) -> ImageProcessor:
        """The processing of the folder's model type (``IMAGE_FAMILIES``), with the server's settings ``options``;
        ``ValueError`` naming what does not fit."""
        config = json.loads((model_dir / "config.json").read_text())
        model_type = config.get("model_type")
        family = IMAGE_FAMILIES.get(model_type) if isinstance(model_type, str) else None
        if family is None:
            raise ValueError(f"{model_dir}: the router processes no images of model type {model_type!r} "
                             f"(it does for {', '.join(IMAGE_FAMILIES)})")
        return cls(family.load(model_dir, config, tokenizer), fetcher=fetcher, cache_bytes=cache_bytes,
                   options=options)

    @property
    def placeholder_id(self) -> int:
        """The token the chat template writes once per image."""
        return self.family.placeholder_id

    def options(self, kwargs: Any) -> dict[str, Any]:
        """A request's ``mm_processor_kwargs`` over the server's (``defaults``): the settings its images are
        processed with; a 400 naming the setting not taken."""
        try:
            return read_options(self.family, {**self.defaults, **(kwargs or {})} if isinstance(kwargs, dict | None)
                                else kwargs, "mm_processor_kwargs")
        except OptionRefused as exc:
            raise bad_request(str(exc), param=exc.field) from None

    def process(self, image: Any, param: str, whole: bool = False,
                options: dict[str, Any] | None = None) -> ProcessedImage:
        """One RGB image through the model's image processor (``whole``: as its whole-image tile alone), with the
        settings ``options`` (the server's by default); a 400 naming ``param`` if it cannot be."""
        return self.family.process(image, param, whole, self.defaults if options is None else options)

    def span(self, height: int, width: int) -> list[int]:
        """The tokens an image of ``height`` x ``width`` processed pixels takes in the prompt."""
        return self.family.span(height, width)

    def chat_render(self, render: ChatRender, images: Sequence[ProcessedImage]) -> ChatRender:
        """How the chat template renders a conversation with the processed ``images``: where the family's
        processor expands each image's placeholder in the text, with its image's text there (a 400 where the
        rendered text does not hold one placeholder per image)."""
        placeholder = self.family.text_placeholder
        if placeholder is None:
            return render
        texts = [self.family.image_text(image) for image in images]

        def expand(text: str) -> str:
            parts = text.split(placeholder)
            self._check_count(len(parts) - 1, len(texts))
            return "".join(part + image for part, image in zip(parts, texts, strict=False)) + parts[-1]

        return dataclasses.replace(render, image_text=expand)

    def expand(self, token_ids: list[int], images: Sequence[ProcessedImage]) -> tuple[list[int], list[ImageInput]]:
        """``token_ids`` with each placeholder (one per image, in order; a 400 otherwise) replaced by
        its image's span (where the text was expanded, ``chat_render``, the span found there); the ``ImageInput``
        of each image the engines take (an image's crops each one of their own)."""
        if self.family.text_placeholder is not None:
            return token_ids, self._spans_in(token_ids, [piece for image in images for piece in image.pieces])
        self._check_count(token_ids.count(self.placeholder_id), len(images))
        out: list[int] = []
        inputs: list[ImageInput] = []
        start = 0
        for image in images:
            at = token_ids.index(self.placeholder_id, start)
            out.extend(token_ids[start:at])
            span = self.family.span_of(image)
            inputs.append(image.engine_input(len(out), len(span)))
            out.extend(span)
            start = at + 1
        out.extend(token_ids[start:])
        return out, inputs

    def _spans_in(self, token_ids: list[int], images: Sequence[ProcessedImage]) -> list[ImageInput]:
        """The ``ImageInput`` of each image whose span the text expansion put in ``token_ids``, at its
        placeholder; a 400 where a span is not whole there, or where a message's text holds an image token the
        spans do not (the engines would refuse it)."""
        inputs: list[ImageInput] = []
        start = 0
        span_tokens: set[int] = set()
        for image in images:
            at = token_ids.index(self.placeholder_id, start)
            span = self.family.span_of(image)
            span_tokens.update(span)
            if token_ids[at:at + len(span)] != span:
                raise bad_request("an image's tokens are not whole after its placeholder: no message's text may "
                                  "hold the model's image tokens", param="messages")
            inputs.append(image.engine_input(at, len(span)))
            start = at + len(span)
        if sum(t in span_tokens for t in token_ids) != sum(i.length for i in inputs):
            raise bad_request("a message's text holds one of the model's image tokens", param="messages")
        return inputs

    @staticmethod
    def _check_count(count: int, num_images: int) -> None:
        """A 400 unless the rendered prompt holds exactly one image token (placeholder) per image. A message's text
        that holds the image token's string is tokenized to it too: counting them all keeps such a text from
        moving an image's span (the engines would refuse the request, or worse, place features elsewhere)."""
        if count != num_images:
            raise bad_request(
                f"the chat template placed {count} image token(s) for {num_images} image(s): each image part is "
                "written as one, and no message's text may hold the image token itself", param="messages")

    def load(self, images: Sequence[ImageRef], fetched: dict[int, bytes] | None = None,
             options: dict[str, Any] | None = None) -> list[ProcessedImage]:
        """Each image decoded (from its data URL, or the bytes ``fetched`` for it), processed with the settings
        ``options`` (``options()``; the server's by default) and hashed, or found processed so in the cache; a 400
        naming the image for a bad one, or for processed pixels past ``MAX_IMAGE_BYTES`` or images (crops
        included) past ``MAX_IMAGES_PER_PROMPT`` in all. Blocks for as long as that takes (``load_off_loop``)."""
        self.check_count(images)
        whole = self.family.whole_when_several and len(images) > 1
        options = self.defaults if options is None else options
        # The way an image is processed: its settings in a canonical form, and whether it is its whole-image tile.
        way = (b"whole " if whole else b"") + json.dumps(options, sort_keys=True).encode() + b"\0"
        processed: list[ProcessedImage] = []
        total = pieces = 0
        for k, ref in enumerate(images):
            data = (fetched or {}).get(k)
            # By the data URL as it came (a hit skips its base64 too), or by the bytes fetched for a URL; and by
            # the way it is processed.
            key = hashlib.sha256(way + (b"data URL\0" if data is None else b"fetched\0"))
            key.update(ref.url.encode() if data is None else data)
            image = self.cache.get(key.digest())
            if image is None:
                picture = _open_image(data_url_bytes(ref.url, ref.param) if data is None else data, ref.param)
                image = self.process(picture, ref.param, whole, options).hashed()
                self.cache.put(key.digest(), image)
            total += image.nbytes
            if total > MAX_IMAGE_BYTES:
                raise bad_request(f"the prompt's images take more than {MAX_IMAGE_BYTES >> 20} MiB once processed "
                                  "(float32 pixels); send fewer or smaller images", param=ref.param)
            pieces += len(image.pieces)
            if pieces > MAX_IMAGES_PER_PROMPT:
                raise bad_request(f"the prompt's images and their crops make more than {MAX_IMAGES_PER_PROMPT} "
                                  "images; send fewer images, or fewer crops of each", param=ref.param)
            processed.append(image)
        return processed

    def prepare(self, token_ids: list[int], images: Sequence[ImageRef], fetched: dict[int, bytes] | None = None,
                options: dict[str, Any] | None = None) -> tuple[list[int], list[ImageInput]]:
        """A prompt already rendered (``chat_render`` needs no images: a family that expands the ids) with its
        images' spans and their ``ImageInput``s (``load``, ``expand``)."""
        return self.expand(token_ids, self.load(images, fetched, options))

    def check_count(self, images: Sequence[ImageRef]) -> None:
        """A 400 naming the second image where the family takes one a prompt (``ImageFamily.max_images``)."""
        limit = self.family.max_images
        if limit is not None and len(images) > limit:
            raise bad_request(f"this model takes at most {limit} image(s) a prompt (its way with several is not "
                              "implemented)", param=images[limit].param)

    async def load_off_loop(self, images: Sequence[ImageRef], options: dict[str, Any] | None = None
                            ) -> list[ProcessedImage]:
        """``load`` (with the settings ``options``) in one of the image threads (decoding, resizing and hashing
        release the GIL), after the images given by http(s) URL are fetched, together, on the event loop."""
        self.check_count(images)  # cheap refusals need no thread
        by_url = [k for k, ref in enumerate(images) if not ref.url.startswith("data:")]
        bodies = await asyncio.gather(*(self.fetcher.fetch(images[k].url, images[k].param) for k in by_url))
        fetched = dict(zip(by_url, bodies, strict=True))
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.load, images, fetched, options)


@dataclass(frozen=True)
class ModelImages:
    """What the served model does with images: ``processor`` where its engines take them, else None and the
    reason they are refused (``refusal``, naming the model type of an image-text model served as text)."""

    processor: ImageProcessor | None = None
    refusal: str = NO_IMAGES
    model_type: str | None = None

    @classmethod
    def from_model_dir(cls, model_dir: pathlib.Path, tokenizer: Any, fetcher: ImageFetcher | None = None,
                       cache_bytes: int = DEFAULT_CACHE_BYTES, options: dict[str, Any] | None = None) -> ModelImages:
        """The model folder's: ``ValueError`` for an image-text model whose processor files do not fit, or settings
        ``options`` (``--mm-processor-kwargs``) its processor does not take (or any, for a model served without
        images). ``fetcher``: where images given by URL come from (``router.image_fetch``; none without);
        ``cache_bytes``: the processed images kept (``ProcessedCache``)."""
        images = cls._from_model_dir(model_dir, tokenizer, fetcher, cache_bytes, options)
        if options and images.processor is None:
            raise ValueError(f"--mm-processor-kwargs: {images.refusal}")
        return images

    def options(self, kwargs: Any) -> dict[str, Any]:
        """A request's ``mm_processor_kwargs`` (``ImageProcessor.options``); a 400 for any, on a model served
        without images."""
        if self.processor is None:
            if kwargs:
                raise bad_request(f"mm_processor_kwargs: {self.refusal}", param="mm_processor_kwargs")
            return {}
        return self.processor.options(kwargs)

    @classmethod
    def _from_model_dir(cls, model_dir: pathlib.Path, tokenizer: Any, fetcher: ImageFetcher | None,
                        cache_bytes: int, options: dict[str, Any] | None) -> ModelImages:
        try:
            config = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError):
            return cls()
        model_type = config.get("model_type") if isinstance(config, dict) else None
        # Every image-text checkpoint has a vision config beside its language model's (``text_config``, or, in
        # Qwen2.5-VL's own folders, the language model's fields at the top): a text model's folder is told apart
        # here without importing the model code (and torch) into the router.
        if not isinstance(model_type, str) or ("text_config" not in config and "vision_config" not in config):
            return cls()
        from common.model.arch import IMAGE_INPUT_TYPES, IMAGE_TEXT_TYPES, image_input_refusal

        if model_type not in IMAGE_TEXT_TYPES:
            return cls()
        if model_type not in IMAGE_INPUT_TYPES:
            return cls(refusal=image_input_refusal(model_type), model_type=model_type)
        try:
            return cls(ImageProcessor.from_model_dir(model_dir, tokenizer, fetcher, cache_bytes, options), "",
                       model_type)
        except ImagesRefused as exc:
            return cls(refusal=str(exc), model_type=model_type)


def truncate_images(images: list[ImageInput], num_removed: int) -> list[ImageInput]:
    """The images of a prompt whose first ``num_removed`` tokens were cut (``truncate_prompt_tokens``), their
    spans moved with it; a 400 where the cut reaches into an image's span."""
    if not num_removed or not images:
        return images
    if images[0].offset < num_removed:
        raise bad_request(f"truncate_prompt_tokens would cut the prompt's first {num_removed} tokens, into an "
                          "image's tokens; keep more tokens or send fewer images", param="truncate_prompt_tokens")
    return [msgspec.structs.replace(image, offset=image.offset - num_removed) for image in images]
