"""Pooling requests (``POST /v1/embeddings``'s engine side): a prompt's last hidden state instead of a token.

The engine's embedding of a prompt is transformers' base model's ``last_hidden_state`` at the prompt's last
token (after the final norm), whatever shares its steps: chunked prefill, a prefix-cache hit, generation
requests in the same batch, async scheduling.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from common.protocol import EVERY_TOKEN_POOLING
from common.sampling_params import SamplingParams
from tests.engine.conftest import hf_model, prompt_ids
from tests.engine.tiny_models import TINY_DIMS, build_tokenizer, prompt_token_ids

POOL = SamplingParams(max_tokens=1, temperature=0.0)


@functools.cache
def hf_last_hidden(prompt: tuple[int, ...]) -> np.ndarray:
    with torch.inference_mode():
        out = hf_model().model(torch.tensor([prompt]))  # the base model: hidden states after the final norm
    return out.last_hidden_state[0, -1].float().numpy()


@functools.cache
def hf_pooled(prompt: tuple[int, ...], pooling: str) -> np.ndarray:
    """sentence-transformers' poolings of transformers' ``last_hidden_state`` over every prompt position (its
    ``Pooling`` module's formulas)."""
    with torch.inference_mode():
        hidden = hf_model().model(torch.tensor([prompt])).last_hidden_state[0].float()
    weights = torch.arange(1, len(prompt) + 1, dtype=torch.float32)[:, None]
    pooled = {"mean": hidden.mean(dim=0), "max": hidden.amax(dim=0), "cls": hidden[0],
              "mean_sqrt_len": hidden.sum(dim=0) / len(prompt) ** 0.5,
              "weightedmean": (hidden * weights).sum(dim=0) / weights.sum()}[pooling]
    return pooled.numpy()


def _embeddings(engine, requests: dict[str, tuple[int, ...]], generate: dict[str, tuple[int, ...]] | None = None,  # type: ignore[no-untyped-def]
                pooling: str = "last"):
    for rid, prompt in requests.items():
        engine.add_request(rid, list(prompt), POOL, pooling=pooling)
    for rid, prompt in (generate or {}).items():
        engine.add_request(rid, list(prompt), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    got: dict[str, np.ndarray] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.request_id in requests:
                assert out.finish_reason == "stop" and out.new_token_ids == [] and out.embedding is not None
                got[out.request_id] = np.frombuffer(out.embedding, dtype="<f4")
            else:
                assert out.embedding is None
    return got, tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_embedding_is_transformers_last_hidden_state_whatever_shares_the_step(engine_factory, async_scheduling: bool) -> None:  # type: ignore[no-untyped-def]
    """Chunks of 16 tokens (the longer prompts over several steps), generation beside it, then the same prompts again:
    whole blocks from the prefix cache, the last token computed again."""
    engine = engine_factory(max_num_batched_tokens=16, block_size=8, async_scheduling=async_scheduling)
    prompts = {f"e{i}": prompt_ids()[i] for i in (2, 6, 12)}  # 11, 61 and 145 tokens
    got, tokens = _embeddings(engine, prompts, {"g": prompt_ids()[3]})
    assert len(tokens["g"]) == 6
    for rid, prompt in prompts.items():
        assert got[rid].shape == (hf_model().config.hidden_size,)
        np.testing.assert_allclose(got[rid], hf_last_hidden(prompt), rtol=1e-4, atol=1e-4)
    hits_before = engine.stats().prefix_cache_hits
    again, _ = _embeddings(engine, {f"again-{rid}": p for rid, p in prompts.items()})
    assert engine.stats().prefix_cache_hits > hits_before
    for rid, prompt in prompts.items():
        np.testing.assert_allclose(again[f"again-{rid}"], hf_last_hidden(prompt), rtol=1e-4, atol=1e-4)
    # Two prompts' embeddings differ (not one row given to all).
    assert not np.allclose(got["e2"], got["e6"])


def test_poolings_over_every_position_equal_transformers_whatever_is_cached_or_preempted(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """sentence-transformers' mean, max, first-token (CLS), mean_sqrt_len and weightedmean poolings of the prompt's
    final hidden states, all in one batch over chunks of 16 tokens with generation beside them, async scheduling; then a prompt again, whose
    blocks are cached: every position is computed again (no hit), the same answer; then in a pool so small
    that the prompt is preempted mid-prompt and computed again from its start."""
    engine = engine_factory(max_num_batched_tokens=16, block_size=8, async_scheduling=True)
    prompts = {(i, kind): prompt_ids()[i] for i in (2, 6) for kind in EVERY_TOKEN_POOLING}  # 11 and 61 tokens

    def run(prefix: str, generate: bool) -> dict[tuple[int, str], np.ndarray]:
        for (i, kind), prompt in prompts.items():
            engine.add_request(f"{prefix}{i}-{kind}", list(prompt), POOL, pooling=kind)
        if generate:
            engine.add_request("g", list(prompt_ids()[3]), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        got: dict[tuple[int, str], np.ndarray] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                if out.request_id != "g":
                    assert out.embedding is not None
                    i, kind = out.request_id.removeprefix(prefix).split("-", 1)
                    got[int(i), kind] = np.frombuffer(out.embedding, dtype="<f4")
        return got

    for key, got in run("", generate=True).items():
        np.testing.assert_allclose(got, hf_pooled(prompts[key], key[1]), rtol=1e-4, atol=1e-4)
        assert not np.allclose(got, hf_last_hidden(prompts[key]), atol=1e-3)  # not the last token's
    hits_before = engine.stats().prefix_cache_hits
    for key, got in run("again-", generate=False).items():
        np.testing.assert_allclose(got, hf_pooled(prompts[key], key[1]), rtol=1e-4, atol=1e-4)
    assert engine.stats().prefix_cache_hits == hits_before
    small = engine_factory(max_num_batched_tokens=16, block_size=8, num_blocks=24)
    small.add_request("gen", list(prompt_ids()[6]), SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    got, _ = _embeddings(small, {"long": prompt_ids()[12]}, pooling="weightedmean")  # 145 tokens: 19 of 24 blocks
    assert small.stats().num_preemptions > 0
    np.testing.assert_allclose(got["long"], hf_pooled(prompt_ids()[12], "weightedmean"), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("params", "kwargs", "message"), [
    (SamplingParams(max_tokens=2, temperature=0.0), {}, "samples nothing"),
    (SamplingParams(max_tokens=1, temperature=0.0, logprobs=2), {}, "samples nothing"),
    (POOL, {"kv_transfer": True}, "runs whole"),
    (POOL, {"output_token_ids": [5]}, "runs whole"),
    (POOL, {"pooling": "sum"}, "pooling 'sum' is not implemented"),
])
def test_what_a_pooling_request_cannot_be_is_refused(engine_factory, params: SamplingParams, kwargs: dict, message: str) -> None:  # type: ignore[no-untyped-def,type-arg]
    engine = engine_factory()
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", list(prompt_ids()[0]), params, **{"pooling": "last", **kwargs})
    assert not engine.has_unfinished_requests()


def _base_model_checkpoint(folder: Path, config) -> Path:  # type: ignore[no-untyped-def]
    """A checkpoint saved as transformers saves a base model (an embedding model's form): ``architectures``
    names the base class, the weights lack the causal LM's ``model.`` prefix and there is no ``lm_head``."""
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(str(folder))
    build_tokenizer(folder)
    return folder


def test_a_base_model_without_its_output_head_serves_embeddings_only(tmp_path: Path) -> None:
    """``Qwen3Model`` saved alone (Qwen3-Embedding's form): its embeddings equal transformers' base model's
    last hidden state; a generation request is refused by name; a base model of a family whose causal LM
    keeps it under another name (GPT-NeoX's) is refused at load."""
    from safetensors import safe_open
    from transformers import AutoModel, GPTNeoXConfig, Qwen3Config

    from common.config import EngineConfig
    from common.engine.engine import LLMEngine

    folder = _base_model_checkpoint(tmp_path / "qwen3-base", Qwen3Config(**TINY_DIMS, tie_word_embeddings=False))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())  # noqa: SIM118 - safe_open is not a mapping
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith(("model.", "lm_head")) for n in names)
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", num_blocks=16, block_size=8,
                                    max_num_batched_tokens=8))
    prompt = prompt_token_ids(13, seed=3)
    with pytest.raises(ValueError, match=r"Qwen3Model, without a language-model output head\) serves pooling requests only"):
        engine.add_request("gen", prompt, SamplingParams(max_tokens=4))
    got, _ = _embeddings(engine, {"e": tuple(prompt)})
    with torch.inference_mode():
        expected = AutoModel.from_pretrained(str(folder)).eval()(torch.tensor([prompt])).last_hidden_state[0, -1]
    np.testing.assert_allclose(got["e"], expected.numpy(), rtol=1e-4, atol=1e-5)
    neox = GPTNeoXConfig(**{k: v for k, v in TINY_DIMS.items() if k not in ("num_key_value_heads", "head_dim")})
    with pytest.raises(ValueError, match="not gpt_neox"):
        LLMEngine(EngineConfig(model=str(_base_model_checkpoint(tmp_path / "neox-base", neox)), device="cpu",
                               dtype="float32", num_blocks=16, block_size=8))


def _classifier_checkpoint(folder: Path, config) -> Path:  # type: ignore[no-untyped-def]
    """A sequence classifier saved as transformers saves one (``...ForSequenceClassification``: the causal
    LM's base model under its own name, ``score`` in place of the output head), random weights."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or ".ln_" in name or name.endswith("bias"):
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(str(folder))
    build_tokenizer(folder)
    return folder


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_a_sequence_classifier_gives_transformers_logits_of_the_last_token(tmp_path: Path, family: str) -> None:
    """``LlamaForSequenceClassification`` and ``GPTNeoXForSequenceClassification`` (whose base model keeps its
    own name, ``gpt_neox.``) with 3 labels: pooling "classify" returns the ``score`` head's logits at the
    prompt's last token, equal to transformers' (prompts over several chunks of 8, then again from the prefix
    cache); "last" the hidden state it scored; generation is refused. A causal LM refuses "classify"."""
    from transformers import AutoModelForSequenceClassification, GPTNeoXConfig, LlamaConfig

    from common.config import EngineConfig
    from common.engine.engine import LLMEngine

    neox_dims = {k: v for k, v in TINY_DIMS.items() if k not in ("num_key_value_heads", "head_dim")}
    config = (LlamaConfig(**TINY_DIMS, num_labels=3) if family == "llama"
              else GPTNeoXConfig(**neox_dims, num_labels=3))
    folder = _classifier_checkpoint(tmp_path / family, config)
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", num_blocks=32, block_size=8,
                                    max_num_batched_tokens=8))
    prompts = {f"c{n}": tuple(prompt_token_ids(n, seed=n)) for n in (5, 19, 30)}
    with pytest.raises(ValueError, match=r"ForSequenceClassification, without a language-model output head\) "
                                         "serves pooling requests only"):
        engine.add_request("gen", list(prompts["c5"]), SamplingParams(max_tokens=4))
    hf = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    for round_ in ("first", "cached"):
        for rid, prompt in prompts.items():
            engine.add_request(f"{round_}-{rid}", list(prompt), POOL, pooling="classify")
        engine.add_request(f"{round_}-hidden", list(prompts["c19"]), POOL, pooling="last")
        got: dict[str, np.ndarray] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None and out.embedding is not None and out.new_token_ids == []
                got[out.request_id] = np.frombuffer(out.embedding, dtype="<f4")
        with torch.inference_mode():
            for rid, prompt in prompts.items():
                expected = hf(torch.tensor([prompt])).logits[0]
                assert got[f"{round_}-{rid}"].shape == (3,)
                np.testing.assert_allclose(got[f"{round_}-{rid}"], expected.numpy(), rtol=1e-4, atol=1e-5)
            base = hf.base_model(torch.tensor([prompts["c19"]])).last_hidden_state[0, -1]
            np.testing.assert_allclose(got[f"{round_}-hidden"], base.numpy(), rtol=1e-4, atol=1e-5)
    assert engine.stats().prefix_cache_hits > 0
    assert not np.allclose(got["cached-c5"], got["cached-c30"])


def test_a_causal_lm_refuses_classification(engine_factory) -> None:  # type: ignore[no-untyped-def]
    engine = engine_factory()
    with pytest.raises(ValueError, match="pooling 'classify': the model \\(a causal LM\\) has no classification head"):
        engine.add_request("x", list(prompt_ids()[0]), POOL, pooling="classify")
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(("family", "tied"), [("qwen3", True), ("llama", False)])
def test_a_causal_lm_made_a_classifier_of_its_tokens_logits_by_hf_overrides(tmp_path: Path, family: str,
                                                                            tied: bool) -> None:
    """vLLM's ``--hf-overrides`` for a causal LM reranker (Qwen3-Reranker's form): the 2-way method's one
    logit is the true token's logit minus the false one's at the prompt's last token (its sigmoid the
    softmax of the two), read from the output head or the tied embeddings; "no_post_processing" gives each
    token's logit. The model is transformers' causal LM, unchanged."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from common.config import EngineConfig
    from common.engine.engine import LLMEngine
    from tests.engine.tiny_models import build_checkpoint

    config_class = Qwen3Config if family == "qwen3" else LlamaConfig
    folder = build_checkpoint(config_class(**TINY_DIMS, tie_word_embeddings=tied), tmp_path / family)
    build_tokenizer(folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts = [prompt_token_ids(n, seed=n) for n in (6, 21)]
    with torch.inference_mode():
        logits = [hf(torch.tensor([p])).logits[0, -1].numpy() for p in prompts]
    arch = "Qwen3ForSequenceClassification" if family == "qwen3" else "LlamaForSequenceClassification"
    for overrides, expected in [
        ({"architectures": [arch], "classifier_from_token": ["w10", "w11"], "is_original_qwen3_reranker": True},
         [[lg[11] - lg[10]] for lg in logits]),
        ({"architectures": [arch], "classifier_from_token": ["w7", "w9", "w3"], "method": "no_post_processing"},
         [lg[[7, 9, 3]] for lg in logits]),
    ]:
        engine = LLMEngine(EngineConfig(model=str(folder), hf_overrides=overrides, device="cpu", dtype="float32",
                                        num_blocks=16, block_size=8, max_num_batched_tokens=8))
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, POOL, pooling="classify")
        got: dict[str, np.ndarray] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None and out.embedding is not None
                got[out.request_id] = np.frombuffer(out.embedding, dtype="<f4")
        for i in range(len(prompts)):
            np.testing.assert_allclose(got[f"r{i}"], expected[i], rtol=1e-4, atol=1e-5)


def test_what_hf_overrides_cannot_make_a_classifier_of_is_refused_by_name(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    from common.config import EngineConfig
    from common.engine.engine import LLMEngine
    from tests.engine.tiny_models import build_checkpoint

    folder = build_checkpoint(LlamaConfig(**TINY_DIMS), tmp_path / "llama")
    build_tokenizer(folder)
    arch = {"architectures": ["LlamaForSequenceClassification"]}
    for overrides, message in [
        ({**arch, "classifier_from_token": ["w10", "w11"], "method": "from_3_way"}, "'from_3_way' is not implemented"),
        ({**arch, "classifier_from_token": ["w10"], "method": "from_2_way_softmax"}, "needs two classifier_from_token"),
        ({**arch, "classifier_from_token": ["w10", "w11"]}, "classifier method None is not implemented"),
        ({**arch, "classifier_from_token": ["w10", "nope"], "method": "from_2_way_softmax"}, r"\['nope'\] are not tokens"),
        ({"classifier_from_token": ["w10", "w11"], "method": "from_2_way_softmax"}, "needs a ...ForSequenceClassification"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLMEngine(EngineConfig(model=str(folder), hf_overrides=overrides, device="cpu", dtype="float32",
                                   num_blocks=16, block_size=8))


def test_hf_overrides_make_one_folder_beside_the_cache_that_every_reader_sees(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import json

    from common.model.loader import model_identity, resolve_model_path

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "my-model"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (source / "tokenizer.json").write_text("{}")
    (source / "1_Pooling").mkdir()
    overrides = {"architectures": ["LlamaForSequenceClassification"], "num_labels": 1}
    first = resolve_model_path(str(source), overrides)
    assert first.name == "my-model" and first != source
    assert json.loads((first / "config.json").read_text()) == {"model_type": "llama", **overrides}
    assert (first / "tokenizer.json").resolve() == (source / "tokenizer.json").resolve()
    assert (first / "1_Pooling").is_dir()
    assert resolve_model_path(str(source), overrides) == first  # made once
    other = resolve_model_path(str(source), {"num_labels": 2})
    assert other != first and json.loads((other / "config.json").read_text())["num_labels"] == 2
    assert resolve_model_path(str(source)) == source and resolve_model_path(str(source), {}) == source
    assert model_identity(first) != model_identity(source)  # blocks hashed apart
    # A cache that cannot be written (a cluster's read-only model volume): the temporary folder.
    import tempfile

    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "not-a-folder"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    fallback = resolve_model_path(str(source), overrides)
    assert fallback.is_relative_to(tmp_path / "tmp") and (fallback / "tokenizer.json").is_file()
    assert resolve_model_path(str(source), overrides) == fallback
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "not-a-folder"))
    with pytest.raises(ValueError, match="--hf-overrides: no folder to write the overridden model in"):
        resolve_model_path(str(source), {"num_labels": 3})
