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

from common.model.loader import classifier_architecture, classifier_from_tokens, num_labels
from common.protocol import PoolingKind
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


# The modes the engines pool (``GenerateRequest.pooling``), by sentence-transformers' names.
_ENGINE_POOLING: dict[str, PoolingKind] = {"lasttoken": "last", "mean": "mean", "max": "max", "cls": "cls",
                                           "mean_sqrt_len": "mean_sqrt_len", "weightedmean": "weightedmean"}

# A cross-encoder's activation as sentence-transformers names it in the model's config.json, by what it is.
_SCORE_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Sigmoid": "classify",
    "torch.nn.modules.activation.Softmax": "classify",
}


@dataclass(frozen=True)
class ClassifierConfig:
    """A sequence classifier's labels and activations, from its ``config.json`` (``/classify``, ``/score``,
    ``/rerank``). ``activation`` (for ``/classify``) follows transformers' loss for the config's
    ``problem_type``, as vLLM does: "identity" for regression, "sigmoid" for multi-label, else a softmax
    over two labels or more and a sigmoid of one. ``score_activation`` (for ``/score`` and ``/rerank``): the
    cross-encoder's own from sentence-transformers' config, else the same rule; any other is kept by name
    and refused on request."""

    architecture: str
    labels: tuple[str, ...]
    activation: str
    score_activation: str
    pad_token_id: int | None = None
    # A pair's input: the tokenizer's encoding of a text with its ``text_pair`` (a cross-encoder's), or of the
    # two texts joined (vLLM's ``use_pad_token`` false: its default for a causal LM made a classifier).
    joins_pairs: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ClassifierConfig | None:
        architecture = classifier_architecture(config)
        if architecture is None:
            return None
        count = num_labels(config)
        id2label = config.get("id2label")
        names = {str(k): str(v) for k, v in id2label.items()} if isinstance(id2label, dict) else {}
        labels = tuple(names.get(str(i), f"LABEL_{i}") for i in range(count))  # transformers' default names
        classify = "softmax" if count > 1 else "sigmoid"
        problem = config.get("problem_type")
        activation = {"regression": "identity", "multi_label_classification": "sigmoid"}.get(str(problem), classify)
        st_config = config.get("sentence_transformers")
        named = st_config.get("activation_fn") if isinstance(st_config, dict) else None
        named = named or config.get("sbert_ce_default_activation_function")
        score = classify if named is None else _SCORE_ACTIVATIONS.get(str(named), str(named))
        from_tokens = classifier_from_tokens(config) is not None
        # A causal LM made a classifier scores its last token, pad or not, as its transformers model does.
        pad = None if from_tokens else config.get("pad_token_id")
        joins = config.get("use_pad_token", not from_tokens) is False
        return cls(architecture, labels, activation, classify if score == "classify" else score,
                   pad if isinstance(pad, int) else None, joins)

    def check_prompts(self, prompts: list[list[int]], param: str) -> None:
        """A 400 for a prompt ending in the model's pad token: transformers' classifier scores the last token
        that is not one (taking it for padding), vLLM's the last token; neither answer would be both's."""
        for i, prompt in enumerate(prompts):
            if self.pad_token_id is not None and prompt and prompt[-1] == self.pad_token_id:
                raise bad_request(f"{param} (input {i}) ends with the model's pad token ({self.pad_token_id}), which "
                                  "transformers' classifier skips as padding: remove it", param=param)

    def outputs(self, logits: bytes, activation: str) -> np.ndarray:
        """The classifier's logits (float32 bytes) through ``activation`` (``identity`` for none), as float64."""
        values = np.frombuffer(logits, dtype="<f4").astype(np.float64)
        if len(values) != len(self.labels):
            raise ValueError(f"a classifier's output of {len(values)} logits for {len(self.labels)} labels")
        if activation == "sigmoid":
            return 1.0 / (1.0 + np.exp(-values))
        if activation == "softmax":
            exp = np.exp(values - values.max())
            return exp / exp.sum()
        assert activation == "identity", activation  # ``check_score`` refused any other
        return values

    def check_score(self) -> None:
        """A 400 unless the model scores a pair: one label (a cross-encoder's, a reranker's or a reward model's),
        and an activation implemented."""
        if len(self.labels) != 1:
            raise bad_request(f"the model ({self.architecture}) has {len(self.labels)} labels: a score needs a "
                              "classifier of one (num_labels 1); /classify gives each label's", param="model")
        if self.score_activation not in ("sigmoid", "softmax", "identity"):
            raise bad_request(f"the model's activation {self.score_activation!r} (its sentence-transformers "
                              "config) is not implemented: Identity, Sigmoid and Softmax are", param="model")


@dataclass(frozen=True)
class PoolingConfig:
    """The model's pooling (``mode``: sentence-transformers' name; served: the last token's hidden state, or
    the mean, max or first (cls) of every position's), whether its embeddings are normalized, and the Matryoshka truncations it allows (``None``: none;
    an empty tuple: any width up to the hidden size)."""

    mode: str = "lasttoken"
    normalize: bool = True
    matryoshka: tuple[int, ...] | None = None
    # A sequence classifier's (``...ForSequenceClassification``), None for any other checkpoint.
    classifier: ClassifierConfig | None = None

    @classmethod
    def from_model_dir(cls, model_dir: pathlib.Path) -> PoolingConfig:
        config_file = model_dir / "config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_file}: expected an object")
        matryoshka, classifier = _matryoshka(config), ClassifierConfig.from_config(config)
        modules_file = model_dir / "modules.json"
        if not modules_file.is_file():
            return cls(matryoshka=matryoshka, classifier=classifier)
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
                if pooling.get("include_prompt") is False:  # an instruction's tokens left out: not implemented
                    mode += " without the prompt (include_prompt false)"
            elif kind.endswith(".Normalize"):
                normalize = True
        return cls(mode=mode, normalize=normalize, matryoshka=matryoshka, classifier=classifier)

    def check(self, dimensions: int | None) -> None:
        """A 400 for a request this model's pooling cannot answer (``dimensions`` past the hidden size: ``embed``)."""
        if self.mode not in _ENGINE_POOLING:
            raise bad_request(
                f"the model's pooling ({self.mode!r}, its sentence-transformers Pooling config) is not implemented: "
                "the engines pool one of sentence-transformers' modes at a time (lasttoken, mean, max, cls, "
                "mean_sqrt_len, weightedmean), over the whole prompt", param="model")
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

    @property
    def engine_pooling(self) -> PoolingKind:
        """What the engines pool for this model's embeddings (``check`` refused any other mode)."""
        return _ENGINE_POOLING[self.mode]

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


def _matryoshka(config: dict[str, Any]) -> tuple[int, ...] | None:
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
        return tuple(dims)
    return () if config.get("is_matryoshka") is True else None


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
