"""The model creator's sampling defaults, from its ``generation_config.json``, as vLLM applies them.

vLLM's ``--generation-config auto`` (its default) reads the model's generation config and uses what it
sets, among temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens, for each request
that leaves that parameter unset: Qwen's chat models then sample at the temperature 0.7 and top_p 0.8 their
creators recommend, not at OpenAI's 1.0. What the file sets counts (with transformers 5, whose
generation config defaults are unset, that is what ``GenerationConfig.to_diff_dict`` gives vLLM); other
keys (``do_sample``, token ids) do not. ``vllm`` leaves them all unset (OpenAI's defaults); a folder reads that folder's file;
``--override-generation-config`` sets any of them over the file's. ``max_new_tokens`` becomes the default
``max_tokens`` of chat completions (a completion's default stays OpenAI's 16, as vLLM's does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.cli import json_object
from common.sampling_params import SamplingParams

# A generation config's key, by the request field it gives a default to.
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_tokens": "max_new_tokens"}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a parameter unset samples with (None: OpenAI's default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    @classmethod
    def load(cls, source: str, model_dir: Path, overrides: dict[str, Any] | None = None) -> SamplingDefaults:
        """``source``: ``auto`` (the model folder's generation config), ``vllm`` (none), or a folder holding a
        ``generation_config.json``; ``overrides`` (generation config keys) over it. ``ValueError`` naming the
        key for one out of range or of another type, or for a folder without the file."""
        values: dict[str, Any] = {}
        if source != "vllm":
            folder = model_dir if source == "auto" else Path(source)
            file = folder / "generation_config.json"
            if file.is_file():
                try:
                    values = json.loads(file.read_text())
                except (OSError, ValueError) as exc:
                    raise ValueError(f"{file}: {exc}") from None
                if not isinstance(values, dict):
                    raise ValueError(f"{file}: expected a JSON object")
            elif source != "auto":
                raise ValueError(f"--generation-config {source}: no generation_config.json there")
        values.update(overrides or {})
        fields = {field: values[key] for field, key in _FIELDS.items() if values.get(key) is not None}
        for field, value in fields.items():
            integer = field in ("top_k", "max_tokens")
            if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
                raise ValueError(f"generation config {_FIELDS[field]}: expected {'an integer' if integer else 'a number'}, "
                                 f"got {value!r}")
        try:
            SamplingParams(**fields).validate()
        except ValueError as exc:  # the message names the request field; name the config's key
            field = str(exc).split(" ", 1)[0]
            raise ValueError(f"generation config {_FIELDS.get(field, field)}: {exc}") from None
        return cls(**fields)

    def describe(self) -> dict[str, Any]:
        """The defaults set, by request field (for the start-up log)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def generation_config_arg(text: str) -> dict[str, Any]:
    """``--override-generation-config``: a JSON object of generation config keys."""
    try:
        return json_object(text, "--override-generation-config")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
