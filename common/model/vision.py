"""An image-text checkpoint's vision side: the tower and projector that turn one image's pixels into the rows
that replace its image tokens' embeddings in the language model.

These run once per image, at the prompt's first chunk that reaches it, beside the language model's forward,
never in a decode step; they are transformers' own modules for the checkpoint's vision config (built from
it, the checkpoint's weights loaded into them), so the features are transformers' by construction. The
language model is this project's (``common.model.llama``).

Families: Mistral 3 (``mistral3``: Mistral Small 3.1 / 3.2, Ministral 3, a Pixtral tower, RMSNorm, the
patch merger and two linear layers). The other image-text checkpoints served as text (Gemma 3, whose image
tokens attend to each other both ways; Qwen2.5-VL and Qwen3-VL, whose positions are three-dimensional) are
refused images by name (``ImageEncoder.for_checkpoint``).
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from common.model.arch import IMAGE_INPUT_TYPES, IMAGE_TEXT_TYPES, image_input_refusal

_VISION_WEIGHT = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")


class ImageEncoderRefused(ValueError):
    """A checkpoint whose images are not implemented (its text is served)."""


class ImageEncoder:
    """One checkpoint's vision tower and projector, on the engine's device in its dtype."""

    def __init__(self, config: Any, modules: nn.Module) -> None:
        self.config = config
        self.modules = modules
        self.image_token_id = int(config.image_token_id)
        vision = config.vision_config
        self.patch_size = int(vision.patch_size)
        self.merge = int(config.spatial_merge_size)
        layer = config.vision_feature_layer
        self.feature_layers: list[int] = [int(layer)] if isinstance(layer, int) else [int(i) for i in layer]

    @staticmethod
    def model_type(path: Path) -> str | None:
        return json.loads((path / "config.json").read_text()).get("model_type")  # type: ignore[no-any-return]

    @classmethod
    def for_checkpoint(cls, path: Path, dtype: torch.dtype, device: torch.device) -> ImageEncoder | None:
        """The encoder of an image-text checkpoint whose images are implemented; None for a text model;
        ``ImageEncoderRefused`` naming the model type for one whose images are not (its text is served)."""
        model_type = cls.model_type(path)
        if model_type not in IMAGE_TEXT_TYPES:
            return None
        if model_type not in IMAGE_INPUT_TYPES:
            raise ImageEncoderRefused(image_input_refusal(model_type))
        from transformers import AutoConfig, AutoModel
        from transformers.initialization import no_init_weights
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        config = AutoConfig.from_pretrained(str(path))
        # Built where they run, uninitialized (the checkpoint's weights replace every parameter; the tower's
        # RoPE tables are computed buffers, which a build on the meta device would leave without data).
        with torch.device(device), no_init_weights():
            modules = nn.Module()
            modules.vision_tower = AutoModel.from_config(config.vision_config)
            modules.multi_modal_projector = Mistral3MultiModalProjector(config)
        state = _vision_weights(path)
        expected = set(modules.state_dict())
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise ValueError(f"checkpoint mismatch in the vision tower: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]} (a quantized vision tower is not implemented)")
        modules.load_state_dict(state)
        for param in modules.parameters():  # the buffers (RoPE tables) stay float32, as transformers keeps them
            param.data = param.data.to(dtype)
        return cls(config, modules.eval())

    def num_features(self, height: int, width: int) -> int:
        """How many image tokens an image of this processed size has (the projector's rows)."""
        step = self.patch_size * self.merge
        return (height // step) * (width // step)

    @property
    def max_side(self) -> int:
        """The largest side of an image the tower takes (its position tables' reach), in whole image tokens."""
        step = self.patch_size * self.merge
        return int(self.config.vision_config.image_size) // step * step

    def check_size(self, height: int, width: int) -> None:
        step = self.patch_size * self.merge
        if height % step or width % step:
            raise ValueError(f"image of {height}x{width} pixels: its sides must be multiples of {step} (the model's "
                             "image processor makes them so)")
        if max(height, width) > self.max_side:
            raise ValueError(f"image of {height}x{width} pixels: the vision tower takes sides of at most "
                             f"{self.max_side}")

    @torch.inference_mode()
    def encode(self, pixels: Tensor, height: int, width: int) -> Tensor:
        """The features ``[num_features, text hidden]`` of one image, ``pixels`` ``[3, height, width]``, as
        transformers' ``get_image_features`` computes them for it alone (its images attend only to
        themselves in the tower, so one at a time is the same image)."""
        tower: nn.Module = self.modules.get_submodule("vision_tower")
        projector: nn.Module = self.modules.get_submodule("multi_modal_projector")
        sizes = torch.tensor([[height, width]], device=pixels.device)
        out = tower(pixels[None], image_sizes=sizes, output_hidden_states=True, return_dict=True)
        hidden = torch.cat([out.hidden_states[i] for i in self.feature_layers], dim=-1)
        features: Tensor = projector(hidden.squeeze(0), sizes)
        return features


def _vision_weights(path: Path) -> dict[str, Tensor]:
    """The checkpoint's vision tower and projector tensors, named as the modules name them."""
    state: dict[str, Tensor] = {}
    with contextlib.ExitStack() as stack:
        for file in sorted(path.glob("*.safetensors")):
            f = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                match = _VISION_WEIGHT.match(name)
                if match is not None:
                    state[name[len(match[1] or ""):]] = f.get_tensor(name)
    return state
