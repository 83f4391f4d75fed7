"""LoRA adapters (``common.model.lora``): the engine's tokens with an adapter equal PEFT's own ``generate``
with it, whatever shares the batch; adapters are kept apart in the prefix cache; what is not built is
refused by name."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.lora_modules import LoRAModule
from common.model.lora import LoRALinear, UnsupportedAdapter
from common.sampling_params import SamplingParams
from tests.engine.test_disaggregated_lifecycle import hand_over
from tests.engine.tiny_models import (
    build_checkpoint,
    family_configs,
    hf_greedy,
    hf_model,
    peft_adapter,
    peft_greedy,
    prompt_token_ids,
)

MAX_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
# Per family: two adapters, by PEFT's target module names (the checkpoint's own: StarCoder2's MLP is c_fc and
# c_proj, Phi-3 stacks q/k/v and gate/up already).
ADAPTERS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "llama-bias": (
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]},
        {"r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": "all-linear"},
    ),
    "phi3-window": (
        {"r": 4, "lora_alpha": 8, "target_modules": ["qkv_proj", "gate_up_proj"]},
        {"r": 2, "lora_alpha": 4, "target_modules": ["o_proj", "down_proj"]},
    ),
    "starcoder2-layernorm-bias-window": (
        {"r": 4, "lora_alpha": 8, "target_modules": ["k_proj", "c_fc"]},
        {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "c_proj"]},
    ),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(base checkpoint, adapter a, adapter b) of a family, built once per module."""
    root = tmp_path_factory.mktemp("lora")

    @functools.cache
    def build(family: str) -> tuple[Path, Path, Path]:
        base = build_checkpoint(family_configs()[family], root / family)
        a_config, b_config = ADAPTERS[family]
        return (base, peft_adapter(base, root / f"{family}-a", seed=1, **a_config),
                peft_adapter(base, root / f"{family}-b", seed=2, **b_config))

    return build


def fp8_dequantized(folder: Path, target: Path) -> Path:
    """The FP8 checkpoint at ``folder`` as the float32 weights it stands for (PEFT's base model), at ``target``."""
    from common.model.quantization import dequantize_fp8

    state = load_file(str(folder / "model.safetensors"))
    for name in [n for n in state if n.endswith("_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        state[weight] = dequantize_fp8(state[weight], state.pop(name), torch.float32)
    target.mkdir(parents=True, exist_ok=True)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    return target


@functools.cache
def _peft(base: Path, adapter: Path | None, prompt: tuple[int, ...]) -> list[int]:
    if adapter is None:
        return hf_greedy(base, list(prompt), MAX_NEW_TOKENS)
    return peft_greedy(base, adapter, list(prompt), MAX_NEW_TOKENS)


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    """Engines a test builds; afterwards every block must be back and each pool sound."""
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.check_integrity()
        assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks, "blocks leaked"


def _engine(engines: list[LLMEngine], base: Path, adapters: dict[str, Path], **overrides: Any) -> LLMEngine:
    config: dict[str, Any] = {
        "model": str(base), "block_size": 8, "num_blocks": 64, "max_num_batched_tokens": 7, "device": "cpu",
        "dtype": "float32", "enable_lora": True,
        "lora_modules": tuple(LoRAModule(name, str(path)) for name, path in adapters.items()),
    }
    config.update(overrides)
    engine = LLMEngine(EngineConfig(**config))
    engines.append(engine)
    return engine


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


_DRAFTS = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'


@pytest.mark.parametrize("engine_config", [{}, {"speculative_config": _DRAFTS}, {"async_scheduling": True}],
                         ids=["plain", "drafts", "async"])
@pytest.mark.parametrize("family", list(ADAPTERS))
def test_each_request_gets_its_adapters_tokens_in_a_batch_that_mixes_them(built, engines, family: str,
                                                                          engine_config: dict[str, Any]) -> None:
    """Two adapters and the base model in one batch, prompts prefilled in chunks beside decodes: each
    request's greedy tokens are PEFT's with its adapter (transformers' without)."""
    base, a, b = built(family)
    engine = _engine(engines, base, {"a": a, "b": b}, **engine_config)
    cases = [("base", None, 19), ("a", a, 21), ("b", b, 17), ("a-again", a, 26), ("b-again", b, 9)]
    for name, adapter, length in cases:
        lora = None if adapter is None else name.removesuffix("-again")
        engine.add_request(name, prompt_token_ids(length, seed=length), GREEDY, lora_name=lora)
    tokens = _run(engine)
    for name, adapter, length in cases:
        prompt = tuple(prompt_token_ids(length, seed=length))
        assert tokens[name] == _peft(base, adapter, prompt), name
        if adapter is not None:  # the adapter changes the tokens, so a request run without it would fail
            assert _peft(base, adapter, prompt) != _peft(base, None, prompt), name


@pytest.mark.parametrize("method", ["gptq", "fp8"])
def test_adapters_on_packed_weights_are_peft_s_on_the_dequantized_model(built, engines, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                         method: str) -> None:
    """A GPTQ or FP8 checkpoint on the Triton kernels (its projections kept packed, ``IntLinear`` / ``Fp8Linear``)
    with an adapter: each request's greedy tokens are PEFT's on the model its weights stand for, with its adapter
    (and without)."""
    from common.model.packed_linear import Fp8Linear, IntLinear
    from tests.engine.tiny_models import fp8_checkpoint, gptq_checkpoint

    base, a, _ = built("llama-bias")
    folder, dequantized = tmp_path / method, tmp_path / "dequantized"
    if method == "gptq":
        gptq_checkpoint(base, folder, dequantized, bits=4, desc_act=False)
    else:
        dequantized = fp8_dequantized(fp8_checkpoint(base, folder), dequantized)
    engine = _engine(engines, folder, {"a": a}, kernel_backend="triton")
    wrapped = [m.base for m in engine.runner.model.modules() if isinstance(m, LoRALinear)]
    assert wrapped and all(isinstance(m, {"gptq": IntLinear, "fp8": Fp8Linear}[method]) for m in wrapped)
    cases = [("base", None, 19), ("a", a, 21)]
    for name, adapter, length in cases:
        engine.add_request(name, prompt_token_ids(length, seed=length), GREEDY, lora_name=None if adapter is None else name)
    tokens = _run(engine)
    for name, adapter, length in cases:
        prompt = tuple(prompt_token_ids(length, seed=length))
        assert tokens[name] == _peft(dequantized, adapter, prompt), name
    assert tokens["a"] != _peft(dequantized, None, tuple(prompt_token_ids(21, seed=21)))


def test_the_kv_of_a_prompt_run_with_an_adapter_goes_to_a_decode_instance_serving_it(built, engines) -> None:
    """Prefill -> KV hand-off -> decode, both with the adapter, two choices forked on the decode instance:
    PEFT's tokens for each. A decode instance hashes the request's blocks under its adapter, so a
    prefill's blocks of another adapter do not match."""
    base, a, b = built("llama-bias")
    prefill = _engine(engines, base, {"a": a, "b": b})
    decode = _engine(engines, base, {"a": a, "b": b})
    prompt = prompt_token_ids(21, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, n=2)
    prefill.add_request("r", prompt, params, kv_transfer=True, lora_name="a")
    while not (outs := prefill.step()):
        pass
    [out] = [o for o in outs if o.kv_handoff is not None]  # choice 0's, with every choice's first token
    choices = out.kv_handoff.choice_token_ids
    mismatched = decode.add_remote_request("r", prompt, out.new_token_ids[0], params, lora_name="b",
                                           choice_token_ids=choices)
    assert mismatched is not None
    assert [bytes(h) for h in mismatched.block_hashes] != [bytes(h) for h in out.kv_handoff.block_hashes]
    decode.release_kv("r")
    handoff = decode.add_remote_request("r", prompt, out.new_token_ids[0], params, lora_name="a",
                                        choice_token_ids=choices)
    assert handoff is not None
    hand_over(prefill, decode, out, handoff)
    tokens = _run(decode)
    assert [out.new_token_ids[0], *tokens["r"]] == _peft(base, a, tuple(prompt))
    assert [choices[1], *tokens["r#1"]] == _peft(base, a, tuple(prompt))


def test_requests_preempted_and_recomputed_keep_their_adapters(built, engines) -> None:
    """A pool too small for the batch: requests are preempted and recomputed, each with its adapter."""
    base, a, b = built("llama-bias")
    engine = _engine(engines, base, {"a": a, "b": b}, num_blocks=10, max_num_batched_tokens=16)
    cases = [(f"r{i}", [None, "a", "b"][i % 3], 15 + i) for i in range(6)]
    for rid, lora, length in cases:
        engine.add_request(rid, prompt_token_ids(length, seed=length), GREEDY, lora_name=lora)
    tokens = _run(engine)
    assert engine.scheduler.num_preemptions > 0
    for rid, lora, length in cases:
        expected = _peft(base, {None: None, "a": a, "b": b}[lora], tuple(prompt_token_ids(length, seed=length)))
        assert tokens[rid] == expected, rid


def test_the_prefix_cache_keeps_each_adapters_blocks_apart(built, engines) -> None:
    """A prompt cached by the base model is computed again with an adapter (its KV differs), then hit by
    the adapter's next request; each gets its own tokens."""
    base, a, _ = built("llama-bias")
    engine = _engine(engines, base, {"a": a})
    prompt = prompt_token_ids(25, seed=9)
    cached: dict[str, int] = {}
    for rid, lora in (("base", None), ("a-first", "a"), ("a-second", "a")):
        engine.add_request(rid, prompt, GREEDY, lora_name=lora)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
                if out.finish_reason is not None:
                    cached[rid] = out.num_cached_tokens
        assert tokens == _peft(base, None if lora is None else a, tuple(prompt)), rid
    assert cached == {"base": 0, "a-first": 0, "a-second": 24}


def test_a_request_naming_an_adapter_the_engine_does_not_serve_is_refused(built, engines) -> None:
    base, a, _ = built("llama-bias")
    engine = _engine(engines, base, {"a": a})
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'b' \(served here: a\)"):
        engine.add_request("r", [5, 6, 7], GREEDY, lora_name="b")
    plain = _engine(engines, base, {}, enable_lora=False)
    with pytest.raises(ValueError, match="serves none"):
        plain.add_request("r", [5, 6, 7], GREEDY, lora_name="a")
    assert not engine.has_unfinished_requests() and not plain.has_unfinished_requests()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"enable_lora": False}, "--lora-modules needs --enable-lora"),
    ({"max_loras": 1}, "--max-loras 1 is below the 2 adapters"),
    ({"max_lora_rank": 0}, "max_lora_rank must be in"),
])
def test_engine_lora_settings_that_are_not_built_are_refused(overrides: dict[str, Any], message: str) -> None:
    config = {"enable_lora": True, "lora_modules": (LoRAModule("a", "x"), LoRAModule("b", "y")), **overrides}
    with pytest.raises(ValueError, match=message):
        EngineConfig(**config)
    with pytest.raises(ValueError, match="a name given twice"):
        EngineConfig(enable_lora=True, lora_modules=(LoRAModule("a", "x"), LoRAModule("a", "y")))


@pytest.mark.parametrize(("text", "expected"), [
    ("sql=/adapters/sql", LoRAModule("sql", "/adapters/sql")),
    ('{"name": "sql", "path": "/a/sql", "base_model_name": "llama"}', LoRAModule("sql", "/a/sql", "llama")),
])
def test_lora_modules_flag_reads_vllms_two_forms(text: str, expected: LoRAModule) -> None:
    assert LoRAModule.parse(text) == expected
    assert LoRAModule.parse(expected.to_arg()).name == expected.name


@pytest.mark.parametrize("text", ["sql", '{"name": "sql"}', '{"name": "x", "path": "p", "rank": 4}', "=path"])
def test_lora_modules_flag_refuses_what_it_cannot_read(text: str) -> None:
    with pytest.raises(ValueError, match="--lora-modules"):
        LoRAModule.parse(text)


def _edited(adapter: Path, target: Path, **config: Any) -> Path:
    """A copy of ``adapter`` with these adapter_config.json fields."""
    target.mkdir(parents=True, exist_ok=True)
    values = {**json.loads((adapter / "adapter_config.json").read_text()), **config}
    (target / "adapter_config.json").write_text(json.dumps(values))
    (target / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    return target


@pytest.mark.parametrize(("config", "message"), [
    ({"use_dora": True}, "use_dora = True is not implemented"),
    ({"bias": "lora_only"}, "bias 'lora_only'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"some_future_field": True}, "some_future_field not implemented"),
    ({"r": 32, "lora_alpha": 8}, "rank 32, above --max-lora-rank 16"),
])
def test_adapters_that_are_not_built_are_refused_by_name(built, tmp_path: Path, config: dict[str, Any],
                                                         message: str) -> None:
    base, a, _ = built("llama-bias")
    bad = _edited(a, tmp_path / "bad", **config)
    with pytest.raises(UnsupportedAdapter, match=message):
        LLMEngine(EngineConfig(model=str(base), device="cpu", dtype="float32", num_blocks=8, enable_lora=True,
                               lora_modules=(LoRAModule("bad", str(bad)),)))


def test_adapted_modules_the_model_does_not_implement_are_refused(built, tmp_path: Path) -> None:
    base, _, _ = built("llama-bias")
    head = peft_adapter(base, tmp_path / "head", r=2, lora_alpha=2, target_modules=["lm_head"])
    # PEFT saves the (tied) output head's own weight beside its A and B: a weight that is no LoRA pair.
    with pytest.raises(UnsupportedAdapter, match="weight base_model.model.lm_head.base_layer.weight is not implemented"):
        LLMEngine(EngineConfig(model=str(base), device="cpu", dtype="float32", num_blocks=8, enable_lora=True,
                               lora_modules=(LoRAModule("head", str(head)),)))
    weights = load_file(str(head / "adapter_model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".lora_" in k}, str(head / "adapter_model.safetensors"))
    with pytest.raises(UnsupportedAdapter, match="LoRA on lm_head is not implemented"):
        LLMEngine(EngineConfig(model=str(base), device="cpu", dtype="float32", num_blocks=8, enable_lora=True,
                               lora_modules=(LoRAModule("head", str(head)),)))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((head / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(UnsupportedAdapter, match="adapter_model.bin is a pickle, which is never loaded"):
        LLMEngine(EngineConfig(model=str(base), device="cpu", dtype="float32", num_blocks=8, enable_lora=True,
                               lora_modules=(LoRAModule("pickled", str(pickled)),)))


def test_queries_and_keys_of_an_interleaved_rope_family_are_refused(tmp_path: Path) -> None:
    """GLM's q and k rows are reordered as its checkpoint loads: an adapter's B for them would need the
    same reordering, not built; its values and MLP are adapted."""
    base = build_checkpoint(family_configs()["glm-interleaved-partial-rope"], tmp_path / "glm")
    qk = peft_adapter(base, tmp_path / "qk", r=2, lora_alpha=2, target_modules=["q_proj"])
    with pytest.raises(UnsupportedAdapter, match="queries and keys of glm"):
        LLMEngine(EngineConfig(model=str(base), device="cpu", dtype="float32", num_blocks=8, enable_lora=True,
                               lora_modules=(LoRAModule("qk", str(qk)),)))
    values = peft_adapter(base, tmp_path / "v", r=2, lora_alpha=4, target_modules=["v_proj", "down_proj"])
    engine = LLMEngine(EngineConfig(model=str(base), device="cpu", dtype="float32", num_blocks=16, block_size=8,
                                    enable_lora=True, lora_modules=(LoRAModule("v", str(values)),)))
    prompt = prompt_token_ids(13, seed=3)
    engine.add_request("r", prompt, GREEDY, lora_name="v")
    assert _run(engine)["r"] == peft_greedy(base, values, prompt, MAX_NEW_TOKENS)


def test_requests_per_adapter_are_exported_by_state(built, engines) -> None:
    from prometheus_client import generate_latest

    from common.metrics import EngineMetrics

    base, a, b = built("llama-bias")
    engine = _engine(engines, base, {"a": a, "b": b}, max_num_seqs=2, max_num_batched_tokens=64)
    for rid, lora in (("r0", "a"), ("r1", "a"), ("r2", "b"), ("r3", None)):
        engine.add_request(rid, prompt_token_ids(9, seed=1), GREEDY, lora_name=lora)
    engine.step()  # r0 and r1 run (two at most), r2 and r3 wait
    metrics = EngineMetrics("decode", "decode-0", "m")
    metrics.update(engine.stats())
    text = generate_latest(metrics.registry).decode()
    at = 'pdserve:lora_requests{instance="decode-0",lora_name="%s",model_name="m",role="decode",state="%s"}'
    assert f"{at % ('a', 'running')} 2.0" in text and f"{at % ('b', 'waiting')} 1.0" in text
    assert f"{at % ('b', 'running')} 0.0" in text and f"{at % ('a', 'waiting')} 0.0" in text
    _run(engine)
    plain = EngineMetrics("decode", "decode-1", "m")
    plain.update(_engine(engines, base, {}, enable_lora=False).stats())
    assert "pdserve:lora_requests{" not in generate_latest(plain.registry).decode()


def test_adapters_load_into_free_slots_and_unload_at_run_time(built, engines) -> None:
    """With slots beyond --lora-modules, every adaptable projection is wrapped: an adapter loaded later
    gives PEFT's tokens beside one loaded at start; a loaded name, a full engine and an adapter in use are
    refused; an unloaded adapter's slot takes the next one."""
    base, a, b = built("llama-bias")
    engine = _engine(engines, base, {"a": a}, max_loras=2, max_lora_rank=8)
    prompt = prompt_token_ids(14, seed=4)
    engine.load_lora(LoRAModule("b", str(b)))
    for name in ("a", "b"):
        engine.add_request(name, prompt, GREEDY, lora_name=name)
    assert _run(engine) == {"a": _peft(base, a, tuple(prompt)), "b": _peft(base, b, tuple(prompt))}
    with pytest.raises(ValueError, match="'b' is already loaded"):
        engine.load_lora(LoRAModule("b", str(b)))
    with pytest.raises(ValueError, match="no free LoRA slot: all 2 of --max-loras hold adapters"):
        engine.load_lora(LoRAModule("c", str(a)))
    engine.add_request("busy", prompt, GREEDY, lora_name="b")
    with pytest.raises(ValueError, match="'b' is in use by 1 request"):
        engine.unload_lora("b")
    _run(engine)
    engine.unload_lora("b")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'b'"):
        engine.add_request("gone", prompt, GREEDY, lora_name="b")
    engine.load_lora(LoRAModule("c", str(a)))  # adapter a's weights again, under another name, in b's slot
    engine.add_request("c", prompt, GREEDY, lora_name="c")
    assert _run(engine)["c"] == _peft(base, a, tuple(prompt))
    full = _engine(engines, base, {"a": a})  # no slot beyond --lora-modules
    with pytest.raises(ValueError, match="no free LoRA slot"):
        full.load_lora(LoRAModule("b", str(b)))


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_decode_steps_with_adapters_run_through_the_padded_graph_path(built, engines, kernel_backend: str) -> None:
    """The static-buffer decode forward a CUDA graph records (run eagerly here): each row's adapter slot a
    one-hot in a static buffer, padding rows and the base model's rows zeros. Base, one adapter and mixed
    steps all replay, and every request gets PEFT's tokens (the Triton kernels through the interpreter)."""
    from tests.engine.test_cuda_graphs import _use_padded_path

    base, a, b = built("llama-bias")
    engine = _engine(engines, base, {"a": a, "b": b}, kernel_backend=kernel_backend, max_model_len=64,
                     max_num_batched_tokens=64)
    runs = _use_padded_path(engine, [2, 4])
    cases = [("base", None, 7), ("a", a, 13), ("b", b, 9)]
    for name, adapter, length in cases:
        engine.add_request(name, prompt_token_ids(length, seed=length), GREEDY, lora_name=None if adapter is None else name)
    tokens = _run(engine)
    for name, adapter, length in cases:
        assert tokens[name] == _peft(base, adapter, tuple(prompt_token_ids(length, seed=length))), name
    assert runs and set(runs) <= {3}  # every decode step replayed, three rows padded to four
    engine.add_request("alone", prompt_token_ids(7, seed=7), GREEDY, lora_name="a")
    assert _run(engine)["alone"] == _peft(base, a, tuple(prompt_token_ids(7, seed=7)))
    assert runs[-1] == 1  # one adapter for the whole step: its rows' one-hot all the same


def test_a_slot_freed_at_run_time_takes_no_adapter_wider_than_those_loaded_at_start(built, engines) -> None:
    """Without slots beyond --lora-modules, the projections are wrapped at the start adapters' rank: an
    adapter of a larger rank loaded into a freed slot is refused by name, nothing changed."""
    base, a, b = built("llama-bias")  # ranks 4 and 8
    engine = _engine(engines, base, {"a": a})
    engine.unload_lora("a")
    with pytest.raises(UnsupportedAdapter, match="rank 8, above the 4 of the adapters loaded at start"):
        engine.load_lora(LoRAModule("b", str(b)))
    engine.load_lora(LoRAModule("a", str(a)))
    prompt = prompt_token_ids(11, seed=2)
    engine.add_request("r", prompt, GREEDY, lora_name="a")
    assert _run(engine)["r"] == _peft(base, a, tuple(prompt))


def test_an_embedding_with_an_adapter_is_pefts_last_hidden_state(built, engines) -> None:  # type: ignore[no-untyped-def]
    """Pooling requests (``/v1/embeddings``) with and without an adapter in one batch: each the last hidden
    state of its own model, PEFT's with the adapter."""
    from peft import PeftModel

    base, adapter, _ = built("llama-bias")
    engine = _engine(engines, base, {"a": adapter})
    prompt = prompt_token_ids(13, seed=5)
    pool = SamplingParams(max_tokens=1, temperature=0.0)
    engine.add_request("adapted", prompt, pool, lora_name="a", pooling="last")
    engine.add_request("base", prompt, pool, pooling="last")
    got: dict[str, torch.Tensor] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None and out.new_token_ids == []
            if out.embedding is not None:
                got[out.request_id] = torch.frombuffer(bytearray(out.embedding), dtype=torch.float32)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        plain = hf_model(base).model(ids).last_hidden_state[0, -1]
        peft = PeftModel.from_pretrained(hf_model(base), str(adapter)).eval()
        adapted = peft.base_model.model.model(ids).last_hidden_state[0, -1]
    torch.testing.assert_close(got["base"], plain, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got["adapted"], adapted, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got["adapted"], got["base"], atol=1e-3)


def test_a_cluster_adapter_that_found_no_slot_loads_once_one_frees(built, engines) -> None:
    """An engine's share of the cluster's runtime adapters (``EngineService._sync_adapters``): one that found
    every slot taken is not tried again each step, but is as soon as an unload frees a slot."""
    from common.service import EngineService

    base, a, b = built("llama-bias")
    engine = _engine(engines, base, {"a": a}, max_loras=2, max_lora_rank=8)
    service = object.__new__(EngineService)  # only what the adapters' bookkeeping reads
    service.engine = engine
    service._adapter_paths = {"a": str(a)}
    service._from_cluster, service._failed_adapters = set(), {}
    service._beat_now = lambda: None  # type: ignore[method-assign]
    service._wanted_adapters = {"b": str(b), "c": str(a)}
    service._sync_adapters()
    assert set(service._adapter_paths) == {"a", "b"} and "c" in service._failed_adapters  # both slots taken
    service._sync_adapters()
    assert set(service._adapter_paths) == {"a", "b"}
    service._wanted_adapters = {"c": str(a)}  # b leaves the cluster: its slot frees, and c takes it
    service._sync_adapters()
    service._sync_adapters()
    assert set(service._adapter_paths) == {"a", "c"} and not service._failed_adapters
    engine.add_request("c", prompt_token_ids(14, seed=4), GREEDY, lora_name="c")
    assert _run(engine)["c"] == _peft(base, a, tuple(prompt_token_ids(14, seed=4)))
