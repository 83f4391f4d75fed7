"""The model's generation config as the sampling defaults of requests that leave a parameter unset (vLLM's
``--generation-config auto``): read from the file as vLLM reads it, applied by the router to what it sends the
engines, overridden, or turned off."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import openai
import pytest

from router.sampling_defaults import SamplingDefaults
from tests.router.router_harness import SERVED_MODEL, fake_stack

# Qwen2.5-Instruct's recommendations, and a top_k and fields that are not sampling defaults.
QWEN_LIKE = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "temperature": 0.7, "top_p": 0.8,
             "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 64}


def _folder(tmp_path: pathlib.Path, generation_config: dict[str, Any]) -> pathlib.Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def test_the_generation_config_s_recommendations_are_read_as_vllm_reads_them(tmp_path: pathlib.Path) -> None:
    folder = _folder(tmp_path, QWEN_LIKE)
    assert SamplingDefaults.load("auto", folder) == SamplingDefaults(0.7, 0.8, 20, None, 1.05, 64)
    assert SamplingDefaults.load(str(folder), tmp_path / "elsewhere") == SamplingDefaults.load("auto", folder)
    assert SamplingDefaults.load("vllm", folder) == SamplingDefaults()  # OpenAI's defaults
    assert SamplingDefaults.load("vllm", folder, {"temperature": 0.5}) == SamplingDefaults(temperature=0.5)
    assert SamplingDefaults.load("auto", folder, {"temperature": 0.5, "min_p": 0.1}) == SamplingDefaults(
        0.5, 0.8, 20, 0.1, 1.05, 64)
    # What the file sets counts, whatever the value (transformers 5's defaults are unset).
    assert SamplingDefaults.load("auto", _folder(tmp_path, {"top_k": 50, "temperature": 1.0})) == \
        SamplingDefaults(temperature=1.0, top_k=50)
    assert SamplingDefaults.load("auto", tmp_path / "no-file") == SamplingDefaults()


@pytest.mark.parametrize(("config", "message"), [
    ({"temperature": -1.0}, "generation config temperature: temperature must be non-negative"),
    ({"top_p": 0.0}, "generation config top_p"),
    ({"top_k": 2.5}, "generation config top_k: expected an integer"),
    ({"max_new_tokens": 0}, "generation config max_new_tokens"),
    ({"repetition_penalty": "high"}, "generation config repetition_penalty: expected a number"),
])
def test_a_default_out_of_range_is_refused_naming_its_key(tmp_path: pathlib.Path, config: dict[str, Any],
                                                           message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingDefaults.load("vllm", tmp_path, config)
    with pytest.raises(ValueError, match="no generation_config.json there"):
        SamplingDefaults.load(str(tmp_path / "missing"), tmp_path)


def test_the_router_sends_the_defaults_for_what_a_request_leaves_unset(redis_url: str, prompts: Any) -> None:
    defaults = SamplingDefaults(0.7, 0.8, 20, None, 1.05, 64)
    with fake_stack(redis_url, prompts, [5, 6, 7], sampling_defaults=defaults) as (server, cluster):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": "Hi."}])
        sent = cluster.requests()[-1].sampling_params
        assert (sent.temperature, sent.top_p, sent.top_k, sent.min_p, sent.repetition_penalty, sent.max_tokens) == (
            0.7, 0.8, 20, 0.0, 1.05, 64)
        # What the request sets wins, zero included; the rest are the defaults.
        client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": "Hi."}],
                                       temperature=0.0, max_tokens=5, extra_body={"top_k": 0})
        sent = cluster.requests()[-1].sampling_params
        assert (sent.temperature, sent.top_p, sent.top_k, sent.max_tokens) == (0.0, 0.8, 0, 5)
        # A completion's max_tokens stays OpenAI's 16, as vLLM's does; its sampling takes the defaults.
        client.completions.create(model=SERVED_MODEL, prompt="Hi.")
        sent = cluster.requests()[-1].sampling_params
        assert (sent.temperature, sent.top_p, sent.max_tokens) == (0.7, 0.8, 16)
