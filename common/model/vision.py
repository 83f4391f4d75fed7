"""An image-text checkpoint's vision side: the tower and projector that turn one image's pixels into the rows
that replace its image tokens' embeddings in the language model, and, for a model whose positions are
three-dimensional, its prompt's rotary positions.

These run once per image, at the prompt's first chunk that reaches it, beside the language model's forward,
never in a decode step; they are transformers' own modules for the checkpoint's vision config (built from
it, the checkpoint's weights loaded into them), so the features are transformers' by construction. The
language model is this project's (``common.model.llama``).

Families (``common.model.arch.IMAGE_INPUT_TYPES``):

- Mistral 3 (``mistral3``: Mistral Small 3.1 / 3.2, Ministral 3): a Pixtral tower over the image's pixels
  (``[3, height, width]``), RMSNorm, the patch merger and two linear layers. Its prompt positions are plain.
- Qwen2-VL and Qwen2.5-VL (``qwen2_vl``, ``qwen2_5_vl``): its tower (Qwen2.5-VL's windowed and full attention
  blocks, Qwen2-VL's all full; the merger) over the image processor's flattened patches (``[grid_h * grid_w, 3 * 2 * 14 * 14]``: a still image is two frames of one, of
  which the router sends one, ``[grid_h * grid_w, 3 * 14 * 14]``).
  Its language model's M-RoPE gives an image's tokens the positions (t, t + row, t + column) from the position
  t the image starts at, and the text after it positions from t + its larger side in tokens on, so every
  token after an image turns by its index plus a (negative) delta (transformers' ``get_rope_index``).
- Qwen3-VL and Qwen3-VL-MoE (``qwen3_vl``, ``qwen3_vl_moe``): Qwen2.5-VL's patches (of 16 pixels) and positions, M-RoPE over
  interleaved columns, and the deepstack: features of the tower's earlier blocks added to the image tokens'
  stream after each of the language model's first layers.

- LLaVA (``llava``: LLaVA 1.5, LLaVA-Interleave, Pixtral 12B's checkpoint in transformers' form): a CLIP or SigLIP
  tower over the image resized to its one size, or a Pixtral tower over an image of any size within its reach;
  the hidden states of its ``vision_feature_layer`` (the CLS position dropped by the ``default`` strategy, as
  transformers drops the first), then two linear layers. Its prompt positions are plain.
- Idefics3 and SmolVLM (``idefics3``, ``smolvlm``): a SigLIP-like tower over tiles of its one size
  (``image_size``): an image split into rows x columns of tiles by its image processor, then the whole image
  resized to one tile (or only that, for an image of one tile); each tile's patches' features shuffled
  ``scale_factor`` x ``scale_factor`` into one row each, then one linear layer. Its prompt positions are plain.
- InternVL (``internvl``: InternVL 3 and 3.5 in transformers' form, a Qwen2 or Qwen3 inside): its InternViT over
  tiles of its one size (a grid by its image processor, then the whole image resized to one tile where there are
  several), the CLS position dropped, each tile's features pixel-shuffled by ``downsample_ratio``, then a LayerNorm
  and two linear layers. Its prompt positions are plain.
- LLaVA-NeXT (``llava_next``: LLaVA 1.6): the image resized and padded to the grid resolution that fits it best
  (``image_grid_pinpoints``), cut in tiles of the CLIP or SigLIP tower's one size, after the whole image resized to
  one tile; each tile's ``vision_feature_layer`` hidden states through the two linear layers; the grid's features
  laid out as the image, the padding's rows or columns cut off, ``image_newline`` after each row
  (transformers' ``pack_image_features``). Its processed size is the image's own (the grid and the cut follow it).
- LLaVA-OneVision (``llava_onevision``): LLaVA-NeXT's tiles (a SigLIP tower, every feature), a grid of more
  features than ``anyres_max_N`` allows resized to fit; in a prompt of several images, each its whole-image tile
  alone and a newline (``ImageInput.whole_image_only``).
- Gemma 3 (``gemma3``): a SigLIP tower over the image resized to its one size (``[3, image_size, image_size]``),
  its patches' features averaged into ``mm_tokens_per_image`` tokens, normed (Gemma's ``1 + weight``) and
  projected. An image's tokens attend to each other both ways in the language model, as transformers masks them
  (``bidirectional``): each sees up to the image's last token, so a prompt chunk holds an image whole
  (``common.engine.scheduler``).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor, nn

from common.model.arch import (
    IMAGE_INPUT_TYPES,
    IMAGE_TEXT_TYPES,
    LLAVA_TOWERS,
    image_input_refusal,
    llava_image_refusal,
    llava_next_image_refusal,
    square_side,
)
from common.protocol import ImageInput


class ImageEncoderRefused(ValueError):
    """A checkpoint whose images are not implemented (its text is served)."""


def model_type_of(path: Path) -> str | None:
    return json.loads((path / "config.json").read_text()).get("model_type")  # type: ignore[no-any-return]


def load_image_encoder(path: Path, dtype: torch.dtype, device: torch.device) -> ImageEncoder | None:
    """The encoder of an image-text checkpoint whose images are implemented; None for a text model;
    ``ImageEncoderRefused`` naming the model type for one whose images are not (its text is served)."""
    model_type = model_type_of(path)
    if model_type not in IMAGE_TEXT_TYPES:
        return None
    if model_type not in IMAGE_INPUT_TYPES:
        raise ImageEncoderRefused(image_input_refusal(model_type))
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    family = {"gemma3": Gemma3Encoder, "idefics3": Idefics3Encoder, "smolvlm": Idefics3Encoder, "internvl": InternVLEncoder,
              "llava": LlavaEncoder,
              "llava_next": LlavaNextEncoder, "llava_onevision": LlavaOnevisionEncoder, "mistral3": PixtralEncoder,
              "qwen2_vl": QwenVLEncoder, "qwen2_5_vl": QwenVLEncoder, "qwen3_vl": Qwen3VLEncoder,
              "qwen3_vl_moe": Qwen3VLEncoder}[model_type]
    return family(config, path, dtype, device)


class ImageEncoder:
    """One checkpoint's vision tower and projector, on the engine's device in its dtype. ``step``: the pixels of
    an image token's side; ``modules``: transformers' modules, named as the checkpoint's tensors are (under an
    optional ``model.``)."""

    image_token_id: int
    step: int
    # Whether an image's tokens attend to each other both ways in the language model (Gemma 3's), not causally:
    # a prompt chunk then holds each image whole (``Request.image_groups``).
    bidirectional = False
    # The checkpoint's tensors this encoder loads: their names' first part (after an optional ``model.``).
    prefixes: tuple[str, ...] = ()
    # The images one prompt may hold, where the family's way with several is not implemented.
    max_images: int | None = None

    def __init__(self, config: Any, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        from transformers.initialization import no_init_weights

        self.config = config
        # Built where they run, uninitialized (the checkpoint's weights replace every parameter; the towers' RoPE
        # tables are computed buffers, which a build on the meta device would leave without data).
        with torch.device(device), no_init_weights():
            modules = self.build(config)
        state = _weights(path, self.prefixes)
        expected = set(modules.state_dict())
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise ValueError(f"checkpoint mismatch in the vision tower: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]} (a quantized vision tower is not implemented)")
        modules.load_state_dict(state)
        for param in modules.parameters():  # the buffers (RoPE tables) stay float32, as transformers keeps them
            param.data = param.data.to(dtype)
        self.modules = modules.eval()

    def build(self, config: Any) -> nn.Module:
        raise NotImplementedError

    def num_features(self, height: int, width: int) -> int:
        """How many image tokens an image of this processed size has (the projector's rows)."""
        return (height // self.step) * (width // self.step)

    def pixel_count(self, height: int, width: int) -> int:
        """The float32 values an image of this processed size comes in (``ImageInput.pixel_values``)."""
        return 3 * height * width

    def largest(self) -> tuple[int, int]:
        """The largest image the tower takes (the profiling run encodes it)."""
        raise NotImplementedError

    def check_size(self, height: int, width: int) -> None:
        """``ValueError`` for a processed size the tower does not take (the model's image processor makes every
        image one it takes)."""
        step = self.step
        if height % step or width % step:
            raise ValueError(f"image of {height}x{width} pixels: its sides must be multiples of {step} (the model's "
                             "image processor makes them so)")
        reason = self.too_large(height, width)
        if reason:
            raise ValueError(f"image of {height}x{width} pixels: {reason}")

    def too_large(self, height: int, width: int) -> str | None:
        raise NotImplementedError

    def encode(self, pixels: Tensor, height: int, width: int) -> Tensor:
        """The features ``[num_features, text hidden]`` of one image (Qwen3-VL's: its deepstack features beside,
        ``Qwen3VLEncoder``) from its ``pixel_count`` float32 values, as
        transformers computes them for it alone (an image attends only to itself in these towers, so one at a
        time is the same image)."""
        raise NotImplementedError

    def rope_positions(self, num_prompt: int, images: list[ImageInput]) -> tuple[np.ndarray, int] | None:
        """A prompt's rotary positions ``[3, num_prompt]`` and the shift of every position after it, where the
        language model's are three-dimensional; None where they are the token's index."""
        return None

    def check_modes(self, images: list[ImageInput]) -> None:
        """``ValueError`` where a prompt's images are not as many, or not in the mode, the family takes them in:
        only LLaVA-OneVision's come as their whole-image tile alone (``ImageInput.whole_image_only``)."""
        if self.max_images is not None and len(images) > self.max_images:
            raise ValueError(f"images: {len(images)} in one prompt; this model takes at most {self.max_images} (its "
                             "way with several is not implemented)")
        for k, image in enumerate(images):
            if image.whole_image_only:
                raise ValueError(f"images[{k}]: whole_image_only is LLaVA-OneVision's mode for several images, not "
                                 "this model's")

    # An image as ``ImageInput`` gives it: by default its processed size says it all (``num_features``,
    # ``pixel_count``, ``encode``); LLaVA-OneVision's mode for several images overrides these.
    def image_features(self, image: ImageInput) -> int:
        return self.num_features(image.height, image.width)

    def image_pixel_count(self, image: ImageInput) -> int:
        return self.pixel_count(image.height, image.width)

    def encode_image(self, pixels: Tensor, image: ImageInput) -> Tensor:
        return self.encode(pixels, image.height, image.width)


class TowerEncoder(ImageEncoder):
    """A family whose checkpoint holds transformers' vision model for its vision config (``vision_tower``) and a
    projector of the family's own (``multi_modal_projector``, built from the whole config)."""

    prefixes: tuple[str, ...] = ("vision_tower", "multi_modal_projector")

    def projector_class(self) -> Any:
        raise NotImplementedError

    def build(self, config: Any) -> nn.Module:
        from transformers import AutoModel

        modules = nn.Module()
        modules.vision_tower = AutoModel.from_config(config.vision_config)
        modules.multi_modal_projector = self.projector_class()(config)
        return modules

    def parts(self) -> tuple[nn.Module, nn.Module]:
        """The tower and the projector."""
        return self.modules.get_submodule("vision_tower"), self.modules.get_submodule("multi_modal_projector")

    def batch(self, tower: nn.Module, pixels: Tensor, height: int, width: int) -> Tensor:
        """One image's pixels as the tower takes a batch of it, in the tower's dtype."""
        return pixels.view(1, 3, height, width).to(next(tower.parameters()).dtype)


def _one_size(side: int, height: int, width: int) -> str | None:
    """Why an image is not the one size a tower takes; None where it is."""
    if (height, width) != (side, side):
        return f"the vision tower takes images of {side} x {side} pixels only"
    return None


def _feature_layers(config: Any) -> list[int]:
    """The tower's layers whose hidden states the projector reads (``vision_feature_layer``: one or a list)."""
    layer = config.vision_feature_layer
    return [int(layer)] if isinstance(layer, int) else [int(i) for i in layer]


def _selected_states(out: Any, layers: list[int], drop_first: bool = False) -> Tensor:
    """The tower's hidden states of ``layers`` side by side, less each row's first position where ``drop_first``
    (the ``default`` strategy's CLS)."""
    return torch.cat([out.hidden_states[i][:, int(drop_first):] for i in layers], dim=-1)


class PixtralEncoder(TowerEncoder):
    """Mistral 3's: a Pixtral tower, the projector's norm, patch merger and two linear layers."""

    def __init__(self, config: Any, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        self.image_token_id = int(config.image_token_id)
        self.patch_size = int(config.vision_config.patch_size)
        self.step = self.patch_size * int(config.spatial_merge_size)
        self.feature_layers = _feature_layers(config)
        super().__init__(config, path, dtype, device)

    def projector_class(self) -> Any:
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        return Mistral3MultiModalProjector

    def largest(self) -> tuple[int, int]:
        """Square, of the tower's position tables' reach (``image_size``), in whole image tokens."""
        side = int(self.config.vision_config.image_size) // self.step * self.step
        return side, side

    def too_large(self, height: int, width: int) -> str | None:
        side = self.largest()[0]
        return f"the vision tower takes sides of at most {side}" if max(height, width) > side else None

    @torch.inference_mode()
    def encode(self, pixels: Tensor, height: int, width: int) -> Tensor:
        tower, projector = self.parts()
        sizes = torch.tensor([[height, width]], device=pixels.device)
        out = tower(pixels.view(1, 3, height, width), image_sizes=sizes, output_hidden_states=True, return_dict=True)
        hidden = _selected_states(out, self.feature_layers)
        features: Tensor = projector(hidden.squeeze(0), sizes)
        return features


class LlavaEncoder(TowerEncoder):
    """LLaVA's: a vision tower (``common.model.arch.LLAVA_TOWERS``), the hidden states of its ``vision_feature_layer`` (a list:
    side by side), less their first position for the ``default`` strategy, through the projector's two linear
    layers. A CLIP or SigLIP tower takes images of its one size (``image_size``) and gives a row per patch (CLIP's
    CLS first); a Pixtral tower takes any size whose sides are multiples of its patch, up to ``image_size``, a
    row per patch."""

    def __init__(self, config: Any, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        vision = config.vision_config
        tower = getattr(vision, "model_type", None)
        strategy = config.vision_feature_select_strategy
        refusal = llava_image_refusal(tower, strategy)
        if refusal is not None:
            raise ImageEncoderRefused(refusal)
        self.image_token_id = int(config.image_token_id)
        self.pixtral = tower == "pixtral"
        self.patch_size = int(vision.patch_size)
        self.side = int(vision.image_size)
        self.step = self.patch_size if self.pixtral else self.side
        self.feature_layers = _feature_layers(config)
        self.drop_first = strategy == "default"
        cls = 1 if LLAVA_TOWERS[str(tower)] else 0
        self.tokens = (self.side // self.patch_size) ** 2 + cls - int(self.drop_first)
        super().__init__(config, path, dtype, device)

    def projector_class(self) -> Any:
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        return LlavaMultiModalProjector

    def num_features(self, height: int, width: int) -> int:
        if self.pixtral:
            return (height // self.patch_size) * (width // self.patch_size) - int(self.drop_first)
        return self.tokens

    def largest(self) -> tuple[int, int]:
        return self.side, self.side

    def too_large(self, height: int, width: int) -> str | None:
        if self.pixtral:
            return f"the vision tower takes sides of at most {self.side}" if max(height, width) > self.side else None
        return _one_size(self.side, height, width)

    @torch.inference_mode()
    def encode(self, pixels: Tensor, height: int, width: int) -> Tensor:
        tower, projector = self.parts()
        extra = {"image_sizes": torch.tensor([[height, width]], device=pixels.device)} if self.pixtral else {}
        out = tower(self.batch(tower, pixels, height, width), output_hidden_states=True, return_dict=True, **extra)
        hidden = _selected_states(out, self.feature_layers, self.drop_first)
        features: Tensor = projector(hidden)[0]
        return features


class LlavaNextEncoder(TowerEncoder):
    """LLaVA-NeXT's (``common.model.vision``'s list): a tower of CLIP's or SigLIP's, the projector's two linear
    layers, transformers' ``pack_image_features`` with the checkpoint's ``image_newline``. An image's processed
    size (``ImageInput.height``, ``width``) is its size as sent: its tiles' count and its features' follow from it
    and ``image_grid_pinpoints``, as transformers' model computes them."""

    prefixes = ("vision_tower", "multi_modal_projector", "image_newline")

    def __init__(self, config: Any, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        vision = config.vision_config
        refusal = llava_next_image_refusal(config.model_type, getattr(vision, "model_type", None),
                                           config.vision_feature_select_strategy,
                                           getattr(config, "vision_aspect_ratio", None))
        if refusal is not None:
            raise ImageEncoderRefused(refusal)
        self.image_token_id = int(config.image_token_id)
        self.step = 1  # any size: the image processor fits it to a grid resolution
        self.side = int(vision.image_size)
        self.per_side = self.side // int(vision.patch_size)
        self.pinpoints = [list(p) for p in config.image_grid_pinpoints]
        self.feature_layers = _feature_layers(config)
        self.drop_first = config.vision_feature_select_strategy == "default"
        super().__init__(config, path, dtype, device)

    def projector_class(self) -> Any:
        from transformers.models.llava_next.modeling_llava_next import LlavaNextMultiModalProjector

        return LlavaNextMultiModalProjector

    def build(self, config: Any) -> nn.Module:
        modules = super().build(config)
        modules.image_newline = nn.Parameter(torch.empty(int(config.text_config.hidden_size)))
        return modules

    def num_tiles(self, height: int, width: int) -> int:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        return int(image_size_to_num_patches((height, width), self.pinpoints, self.side))

    def num_features(self, height: int, width: int) -> int:
        """The whole image's tile, then the grid's features less its padding, a newline after each row."""
        from transformers.models.llava_next.modeling_llava_next import (
            get_anyres_image_grid_shape,
            unpad_image,
        )

        rows, cols = get_anyres_image_grid_shape((height, width), self.pinpoints, self.side)
        grid = unpad_image(torch.empty(0, rows * self.per_side, cols * self.per_side), (height, width))
        rows, cols = self.grid_shape(int(grid.shape[1]), int(grid.shape[2]))
        return self.per_side ** 2 + rows * (cols + 1)

    def grid_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """The grid's features, rows by columns, as packed from its unpadded ``rows`` x ``cols``."""
        return rows, cols

    def pixel_count(self, height: int, width: int) -> int:
        return self.num_tiles(height, width) * 3 * self.side * self.side

    def largest(self) -> tuple[int, int]:
        """The grid resolution of the most pixels (an image of that size fills it, nothing cut)."""
        height, width = max(self.pinpoints, key=lambda p: p[0] * p[1])
        return int(height), int(width)

    def too_large(self, height: int, width: int) -> str | None:
        return None if min(height, width) >= 1 else "its sides must be at least a pixel"

    def tile_features(self, pixels: Tensor, num_tiles: int) -> Tensor:
        """Each of ``num_tiles`` tiles' features ``[tiles, per tile, text hidden]``: its layers' hidden states,
        projected."""
        tower, projector = self.parts()
        tiles = pixels.view(num_tiles, 3, self.side, self.side)
        out = tower(tiles.to(next(tower.parameters()).dtype), output_hidden_states=True, return_dict=True)
        hidden = _selected_states(out, self.feature_layers, self.drop_first)
        features: Tensor = projector(hidden)
        return features

    def pack(self, tiles: Tensor, height: int, width: int) -> Tensor:
        """The image's features from its tiles', as transformers' ``LlavaNextModel`` packs them."""
        from transformers.models.llava_next.modeling_llava_next import LlavaNextModel

        packed, _ = LlavaNextModel.pack_image_features(
            SimpleNamespace(config=self.config), [tiles], torch.tensor([[height, width]]),
            self.config.vision_feature_select_strategy, image_newline=self.modules.get_parameter("image_newline"))
        features: Tensor = packed[0]
        return features

    @torch.inference_mode()
    def encode(self, pixels: Tensor, height: int, width: int) -> Tensor:
        return self.pack(self.tile_features(pixels, self.num_tiles(height, width)), height, width)


class LlavaOnevisionEncoder(LlavaNextEncoder):
    """LLaVA-OneVision's: LLaVA-NeXT's tiles, packed as transformers' ``LlavaOnevisionModel`` packs them: a grid of
    more features than ``vision_aspect_ratio``'s ``anyres_max_N`` allows (N tiles' worth, by over 10%) resized
    bilinearly to fit, before the newlines. In a prompt of several images, each image is its whole-image tile alone
    (padded to a square, resized to one tile: ``ImageInput.whole_image_only``), its features that tile's and a
    newline, as transformers runs a sample of several images; a prompt of one image takes its grid."""

    def __init__(self, config: Any, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, path, dtype, device)  # its refusals first
        self.max_tiles = int(str(config.vision_aspect_ratio).removeprefix("anyres_max_"))

    def projector_class(self) -> Any:
        from transformers.models.llava_onevision.modeling_llava_onevision import (
            LlavaOnevisionMultiModalProjector,
        )

        return LlavaOnevisionMultiModalProjector

    def check_modes(self, images: list[ImageInput]) -> None:
        several = len(images) > 1
        for k, image in enumerate(images):
            if image.whole_image_only != several:
                raise ValueError(f"images[{k}]: in a prompt of {len(images)} image(s), LLaVA-OneVision takes each "
                                 f"{'as its whole-image tile alone' if several else 'with its grid of tiles'} "
                                 f"(whole_image_only {several})")

    def image_features(self, image: ImageInput) -> int:
        return self.per_side ** 2 + 1 if image.whole_image_only else self.num_features(image.height, image.width)

    def image_pixel_count(self, image: ImageInput) -> int:
        return 3 * self.side * self.side if image.whole_image_only else self.pixel_count(image.height, image.width)

    @torch.inference_mode()
    def encode_image(self, pixels: Tensor, image: ImageInput) -> Tensor:
        if not image.whole_image_only:
            return self.encode(pixels, image.height, image.width)
        # one tile: its features, then the newline
        return self.pack(self.tile_features(pixels, 1), image.height, image.width)

    def grid_shape(self, rows: int, cols: int) -> tuple[int, int]:
        ratio = math.sqrt(rows * cols / (self.max_tiles * self.per_side ** 2))
        return (int(rows // ratio), int(cols // ratio)) if ratio > 1.1 else (rows, cols)

    def pack(self, tiles: Tensor, height: int, width: int) -> Tensor:
        from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

        packed, _ = LlavaOnevisionModel.pack_image_features(
            SimpleNamespace(config=self.config), [tiles], torch.tensor([[height, width]]),
            image_newline=self.modules.get_parameter("image_newline"),
            vision_aspect_ratio=self.config.vision_aspect_ratio)
        features: Tensor = packed[0]
        return features


class Gemma3Encoder(TowerEncoder):
    """Gemma 3's: a SigLIP tower, then the projector (average pooling to ``mm_tokens_per_image`` tokens, Gemma's
    RMSNorm, the projection). Every image is the one size the tower takes; its tokens attend to each other both
    ways."""

    bidirectional = True

    def __init__(self, config: Any, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        self.image_token_id = int(config.image_token_id)
        self.side = int(config.vision_config.image_size)
        self.step = self.side
        self.tokens = int(config.mm_tokens_per_image)
        super().__init__(config, path, dtype, device)

    def projector_class(self) -> Any:
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        return Gemma3MultiModalProjector

    def num_features(self, height: int, width: int) -> int:
        return self.tokens

    def largest(self) -> tuple[int, int]:
        return self.side, self.side

    def too_large(self, height: int, width: int) -> str | None:
        return _one_size(self.side, height, width)

    @torch.inference_mode()
    def encode(self, pixels: Tensor, height: int, width: int) -> Tensor:
        tower, projector = self.parts()
        hidden = tower(pixel_values=self.batch(tower, pixels, height, width), return_dict=True).last_hidden_state
        features: Tensor = projector(hidden)[0]
        return features


class Idefics3Encoder(ImageEncoder):
    """Idefics3's and SmolVLM's: the tower (``vision_model``) over each tile of the tower's one size, the
    connector (pixel shuffle, one linear layer) over its last hidden state, a tile's ``image_seq_len`` rows after
    another. An image's processed size is its grid of tiles: ``rows * tile`` x ``columns * tile`` pixels for a
    split image, whose pixels are its tiles row by row and then the whole image resized to one tile; ``tile`` x
    ``tile`` for an image of one tile, whose pixels are that tile alone (transformers' image processor: an image is
    split only where a side is longer than one tile)."""

    prefixes = ("vision_model", "connector")

    def __init__(self, config: Any, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        vision = config.vision_config
        self.image_token_id = int(config.image_token_id)
        self.side = int(vision.image_size)
        self.step = self.side
        scale = int(config.scale_factor)
        self.tokens = (self.side // int(vision.patch_size)) ** 2 // scale ** 2
        self.longest = _tiled_longest_side(path, self.side)
        super().__init__(config, path, dtype, device)

    def build(self, config: Any) -> nn.Module:
        if config.model_type == "smolvlm":
            from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector as Connector
            from transformers.models.smolvlm.modeling_smolvlm import SmolVLMVisionTransformer as Tower
        else:
            from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector as Connector
            from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer as Tower
        modules = nn.Module()
        modules.vision_model = Tower._from_config(config.vision_config)
        modules.connector = Connector(config)
        return modules

    def num_tiles(self, height: int, width: int) -> int:
        """The tiles an image of this processed size comes in: its grid's, and the whole image as one, or one."""
        if (height, width) == (self.side, self.side):
            return 1
        return (height // self.side) * (width // self.side) + 1

    def num_features(self, height: int, width: int) -> int:
        return self.num_tiles(height, width) * self.tokens

    def pixel_count(self, height: int, width: int) -> int:
        return self.num_tiles(height, width) * 3 * self.side * self.side

    def largest(self) -> tuple[int, int]:
        return self.longest, self.longest

    def too_large(self, height: int, width: int) -> str | None:
        if max(height, width) > self.longest:
            return f"the image processor makes sides of at most {self.longest}"
        return None

    @torch.inference_mode()
    def encode(self, pixels: Tensor, height: int, width: int) -> Tensor:
        tower, connector = self.modules.get_submodule("vision_model"), self.modules.get_submodule("connector")
        tiles = pixels.view(self.num_tiles(height, width), 3, self.side, self.side)
        hidden = tower(pixel_values=tiles.to(next(tower.parameters()).dtype), return_dict=True).last_hidden_state
        features: Tensor = connector(hidden)
        return features.reshape(-1, features.shape[-1])


class InternVLEncoder(TowerEncoder):
    """InternVL's (InternVL 3 and 3.5 in transformers' form): its vision transformer (InternViT) over each tile of
    the tower's one size, the hidden states of ``vision_feature_layer`` (the last: after the tower's final norm),
    less the CLS position for the ``default`` strategy, pixel-shuffled by ``downsample_ratio``, through the
    projector (a LayerNorm and two linear layers), a tile's features after another. Its image processor (GOT-OCR2's,
    which InternVL's processor runs with ``crop_to_patches``) cuts an image into a grid of tiles and, where there
    are several, adds the whole image resized to one tile; the processed size here is a column of those tiles,
    ``tiles * tile`` x ``tile`` pixels, the pixels the tiles in the processor's order."""

    def __init__(self, config: Any, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        vision = config.vision_config
        self.image_token_id = int(config.image_token_id)
        self.side = square_side(vision.image_size, "image_size", ImageEncoderRefused)
        patch = square_side(vision.patch_size, "patch_size", ImageEncoderRefused)
        self.ratio = float(config.downsample_ratio)
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ImageEncoderRefused(f"image input with vision_feature_select_strategy {strategy!r} is not "
                                      "implemented (default, full)")
        self.drop_first = strategy == "default"
        self.layer = int(config.vision_feature_layer)
        self.step = self.side
        self.tokens = int((self.side // patch) ** 2 * self.ratio ** 2)
        self.max_tiles = _internvl_max_tiles(path)
        super().__init__(config, path, dtype, device)

    def projector_class(self) -> Any:
        from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector

        return InternVLMultiModalProjector

    def num_features(self, height: int, width: int) -> int:
        return height // self.side * self.tokens

    def largest(self) -> tuple[int, int]:
        return self.max_tiles * self.side, self.side

    def too_large(self, height: int, width: int) -> str | None:
        if width != self.side:
            return f"InternVL's images are a column of tiles {self.side} pixels wide"
        if height > self.max_tiles * self.side:
            return f"the image processor makes at most {self.max_tiles} tiles"
        return None

    @torch.inference_mode()
    def encode(self, pixels: Tensor, height: int, width: int) -> Tensor:
        from transformers.models.internvl.modeling_internvl import InternVLModel

        tower, projector = self.parts()
        tiles = pixels.view(height // self.side, 3, self.side, self.side).to(next(tower.parameters()).dtype)
        out = tower(pixel_values=tiles, output_hidden_states=self.layer != -1, return_dict=True)
        hidden = out.last_hidden_state if self.layer == -1 else out.hidden_states[self.layer]
        hidden = hidden[:, int(self.drop_first):]
        side = int(hidden.shape[1] ** 0.5)
        # transformers' own shuffle (it reads nothing of the model it is a method of)
        shuffled = InternVLModel.pixel_shuffle(None, hidden.reshape(hidden.shape[0], side, side, -1),  # type: ignore[arg-type]
                                               scale_factor=self.ratio)
        features: Tensor = projector(shuffled.reshape(shuffled.shape[0], -1, shuffled.shape[-1]))
        return features.reshape(-1, features.shape[-1])


def _internvl_max_tiles(path: Path) -> int:
    """The most tiles InternVL's image processor makes of an image (``max_patches``, and the whole image beside
    them where there is more than one), from ``preprocessor_config.json`` or transformers' default."""
    file = path / "preprocessor_config.json"
    spec = json.loads(file.read_text()) if file.is_file() else {}
    most = int(spec.get("max_patches", 12))
    return most + 1 if most > 1 else 1


def _tiled_longest_side(path: Path, tile: int) -> int:
    """The longest side, in pixels, of an image Idefics3's image processor makes for the folder
    (``preprocessor_config.json``): ``size.longest_edge`` rounded up to whole tiles where it splits images, else
    one tile. ``ValueError`` where its tiles are not the tower's size."""
    file = path / "preprocessor_config.json"
    spec = json.loads(file.read_text()) if file.is_file() else {}
    # transformers' defaults for both families
    max_tile = (spec.get("max_image_size") or {}).get("longest_edge", 364)
    if max_tile != tile:
        raise ValueError(f"{path}: the image processor's max_image_size {max_tile!r} is not the vision tower's "
                         f"image_size {tile}")
    if not spec.get("do_image_splitting", True):
        return tile
    longest = min(int((spec.get("size") or {}).get("longest_edge", 4 * 364)), 4096)
    return -(-longest // tile) * tile


class QwenVLEncoder(ImageEncoder):
    """Qwen2.5-VL's (and Qwen2-VL's: the same patches, positions and layout, its tower's blocks all of full
    attention): its vision transformer and merger (``visual``), over the processor's patches; M-RoPE."""

    prefixes = ("visual",)

    def __init__(self, config: Any, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        vision = config.vision_config
        self.image_token_id = int(config.image_token_id)
        self.patch_size = int(vision.patch_size)
        self.merge = int(vision.spatial_merge_size)
        self.temporal_patch_size = int(vision.temporal_patch_size)
        self.patch_width = 3 * self.temporal_patch_size * self.patch_size ** 2
        self.step = self.patch_size * self.merge
        # The image processor's bound on an image's pixels (``max_pixels``), where its file says it.
        self.max_pixels = _max_pixels(path)
        super().__init__(config, path, dtype, device)

    def build(self, config: Any) -> nn.Module:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        tower = (Qwen2VisionTransformerPretrainedModel if config.model_type == "qwen2_vl"
                 else Qwen2_5_VisionTransformerPretrainedModel)
        modules = nn.Module()
        modules.visual = tower._from_config(config.vision_config)
        return modules

    def pixel_count(self, height: int, width: int) -> int:
        """One frame of each patch (the router sends one of a still image's equal frames)."""
        return (height // self.patch_size) * (width // self.patch_size) * 3 * self.patch_size ** 2

    def largest(self) -> tuple[int, int]:
        """A square of the image processor's ``max_pixels``, in whole image tokens."""
        side = math.isqrt(self.max_pixels) // self.step * self.step
        return side, side

    def too_large(self, height: int, width: int) -> str | None:
        if height * width > self.max_pixels:
            return f"the image processor's max_pixels is {self.max_pixels}"
        return None

    def run_tower(self, pixels: Tensor, height: int, width: int) -> Any:
        """The vision transformer's output for one image's patches (its grid of one frame)."""
        grid = torch.tensor([[1, height // self.patch_size, width // self.patch_size]], device=pixels.device)
        # Each patch's channel, frame, row and column, as the image processor lays them: its frame repeated.
        frame = pixels.view(-1, 3, 1, self.patch_size ** 2)
        patches = frame.expand(-1, 3, self.temporal_patch_size, -1).reshape(-1, self.patch_width)
        visual: nn.Module = self.modules.get_submodule("visual")
        return visual(patches.to(next(visual.parameters()).dtype), grid_thw=grid, return_dict=True)

    @torch.inference_mode()
    def encode(self, pixels: Tensor, height: int, width: int) -> Tensor:
        features: Tensor = self.run_tower(pixels, height, width).pooler_output
        return features

    def rope_positions(self, num_prompt: int, images: list[ImageInput]) -> tuple[np.ndarray, int]:
        """transformers' ``get_rope_index`` for one prompt of still images: text positions count on; an image's
        tokens, row by row, are (t, t + row, t + column) from the position t it starts at, and the count goes on
        from t + its larger side in tokens."""
        positions = np.empty((3, num_prompt), dtype=np.int64)
        index = position = 0
        for image in images:
            text = image.offset - index
            positions[:, index:image.offset] = np.arange(position, position + text)
            position += text
            rows, cols = image.height // self.step, image.width // self.step
            grid_rows, grid_cols = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
            span = slice(image.offset, image.offset + image.length)
            positions[0, span] = position
            positions[1, span] = position + grid_rows.reshape(-1)
            positions[2, span] = position + grid_cols.reshape(-1)
            position += max(rows, cols)
            index = image.offset + image.length
        positions[:, index:] = np.arange(position, position + num_prompt - index)
        return positions, int(positions.max()) + 1 - num_prompt


class Qwen3VLEncoder(QwenVLEncoder):
    """Qwen3-VL's: its vision transformer, whose merger's features replace the image tokens' embeddings and whose
    deepstack mergers' (of earlier blocks, ``deepstack_visual_indexes``) join the language model's stream at the
    image tokens after each of its first layers; M-RoPE over interleaved columns (``common.model.llama``). The
    features come as one row per image token: the merger's, then each deepstack merger's, side by side."""

    def build(self, config: Any) -> nn.Module:
        from transformers import AutoModel

        modules = nn.Module()
        modules.visual = AutoModel.from_config(config.vision_config)
        return modules

    @torch.inference_mode()
    def encode(self, pixels: Tensor, height: int, width: int) -> Tensor:
        out = self.run_tower(pixels, height, width)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)


def _max_pixels(path: Path) -> int:
    """Qwen2-VL's image processor's ``max_pixels`` (``size.longest_edge`` in transformers 5), or its default."""
    file = path / "preprocessor_config.json"
    spec = json.loads(file.read_text()) if file.is_file() else {}
    value = spec.get("max_pixels") or (spec.get("size") or {}).get("longest_edge") or 12_845_056
    return int(value)


def _weights(path: Path, prefixes: tuple[str, ...]) -> dict[str, Tensor]:
    """The checkpoint's tensors under ``prefixes`` (after an optional ``model.``), named as the modules name them."""
    pattern = re.compile(rf"^(model\.)?({'|'.join(prefixes)})(\.|$)")
    state: dict[str, Tensor] = {}
    with contextlib.ExitStack() as stack:
        for file in sorted(path.glob("*.safetensors")):
            f = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                match = pattern.match(name)
                if match is not None:
                    state[name[len(match[1] or ""):]] = f.get_tensor(name)
    return state
