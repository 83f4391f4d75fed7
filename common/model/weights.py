"""Build the model from a checkpoint folder and load its safetensors weights."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import safe_open

from common.model.arch import SUPPORTED_MODEL_TYPES, ModelArch
from common.model.llama import LlamaForCausalLM

__all__ = ["SUPPORTED_MODEL_TYPES", "load_hf_config", "load_model"]


def load_hf_config(path: Path) -> Any:
    """The checkpoint's transformers config; raises ``UnsupportedConfig`` (naming the field) for
    anything the model does not implement, before any weight is read."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    ModelArch.from_config(config)
    return config


def load_model(
    path: Path, config: Any, kernels: ModuleType, dtype: torch.dtype, device: torch.device, max_position: int
) -> LlamaForCausalLM:
    """The model in eval mode on ``device``; every parameter must come from the checkpoint."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, kernels, max_position)
    # Buffers (rope tables) are computed, not loaded: rebuild them for real.
    model.rotary_emb = type(model.rotary_emb)(config, model.head_size, max_position)
    state: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if "rotary_emb.inv_freq" in name:
                    continue
                state[name] = f.get_tensor(name)
    if model.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {n for n, _ in model.named_parameters()}
    if model.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = expected - state.keys()
    unexpected = state.keys() - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if model.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device=device, dtype=dtype).eval()
