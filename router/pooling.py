"""How an embedding is made of the hidden state the engines pool (``POST /v1/embeddings``).

An embedding model saved by sentence-transformers says so beside its weights: ``modules.json`` lists its
modules (a ``Pooling`` module, whose ``config.json`` names the pooling mode, and a ``Normalize`` module
or none), and ``config.json`` may say it was trained for Matryoshka truncation (``is_matryoshka``,
``matryoshka_dimensions``), as vLLM reads them. Decoder embedders (Qwen3-Embedding, e5-mistral,
gte-Qwen2) pool the last token and normalize. A model without ``modules.json`` (a generative model) is
pooled as vLLM pools a decoder by default: its last token, normalized.

The engines return the last token's final hidden state; the router normalizes and truncates it. A pooling
mode the engines do not compute (mean, CLS, max...) is refused by name on every embeddings request, never
answered with the last token's state.
"""

from __future__ import annotations

import base64
import json
import pathlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from router.errors import bad_request

# sentence-transformers' ``Pooling`` flags, by the mode each names.
_MODE_FLAGS = {
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}


@dataclass(frozen=True)
class PoolingConfig:
    """The model's pooling (``mode``: sentence-transformers' name, ``lasttoken`` being the one served),
    whether its embeddings are normalized, and the Matryoshka truncations it allows (``None``: none;
    an empty tuple: any width up to the hidden size)."""

    mode: str = "lasttoken"
    normalize: bool = True
    matryoshka: tuple[int, ...] | None = None

    @classmethod
    def from_model_dir(cls, model_dir: pathlib.Path) -> PoolingConfig:
        matryoshka = _matryoshka(model_dir / "config.json")
        modules_file = model_dir / "modules.json"
        if not modules_file.is_file():
            return cls(matryoshka=matryoshka)
        modules = _read_json(modules_file)
        if not isinstance(modules, list):
            raise ValueError(f"{modules_file}: expected a list of modules")
        mode, normalize = "lasttoken", False
        for module in modules:
            kind = str(module.get("type", "")) if isinstance(module, dict) else ""
            if kind.endswith(".Pooling"):
                pooling = _read_json(model_dir / str(module.get("path", "")) / "config.json")
                chosen = [name for flag, name in _MODE_FLAGS.items() if pooling.get(flag)]
                mode = "+".join(chosen) or "none"
            elif kind.endswith(".Normalize"):
                normalize = True
        return cls(mode=mode, normalize=normalize, matryoshka=matryoshka)

    def check(self, dimensions: int | None) -> None:
        """A 400 for a request this model's pooling cannot answer (``dimensions`` past the hidden size: ``embed``)."""
        if self.mode != "lasttoken":
            raise bad_request(
                f"the model's pooling ({self.mode!r}, its sentence-transformers Pooling config) is not implemented: "
                "the engines pool the last token only", param="model")
        if dimensions is None:
            return
        if dimensions < 1:
            raise bad_request(f"dimensions must be positive, got {dimensions}", param="dimensions")
        if self.matryoshka is None:
            raise bad_request("dimensions: the model does not support Matryoshka representation (its config.json "
                              "names neither is_matryoshka nor matryoshka_dimensions)", param="dimensions")
        if self.matryoshka and dimensions not in self.matryoshka:
            raise bad_request(f"dimensions must be one of {list(self.matryoshka)}, got {dimensions}",
                              param="dimensions")

    def embed(self, hidden: bytes, dimensions: int | None, normalize: bool | None = None) -> np.ndarray:
        """The embedding of a pooled hidden state (float32 bytes): truncated to ``dimensions``, then
        normalized where the model normalizes (as sentence-transformers truncates, then normalizes), or as
        ``normalize`` says (vLLM's request extra)."""
        vector = np.frombuffer(hidden, dtype="<f4")
        if dimensions is not None:
            if dimensions > len(vector):
                raise bad_request(f"dimensions must be at most the model's {len(vector)}, got {dimensions}",
                                  param="dimensions")
            vector = vector[:dimensions]
        if not (self.normalize if normalize is None else normalize):
            return vector
        norm = float(np.linalg.norm(vector.astype(np.float64)))
        return vector / np.float32(max(norm, 1e-12))  # torch.nn.functional.normalize's epsilon


def encode_embedding(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: a list of floats, or base64 of the float32 little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector.tolist()]


def _matryoshka(config_file: pathlib.Path) -> tuple[int, ...] | None:
    if not config_file.is_file():
        return None
    config = _read_json(config_file)
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
        return tuple(dims)
    return () if config.get("is_matryoshka") is True else None


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
