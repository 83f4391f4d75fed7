"""The KV cache's size on a GPU: this engine's share of the GPU, less what it holds, never more than
is free; two engines on one GPU fit when their shares do. Run on the CPU with the CUDA memory queries
answered by the test (``_num_blocks`` reads nothing else of the GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.engine.model_runner import _GPU_ACTIVATION_HEADROOM, ModelRunner, gpu_kv_cache_bytes
from common.model.parallel import SINGLE

GIB = 1 << 30
TOTAL = 80 * GIB
CONTEXT = GIB // 2  # the CUDA context: counted by the driver, not by torch's reservation


def _two_engines_on_one_gpu(utilization: float, weights: int = 2 * GIB) -> list[int]:
    """Two engines start on one GPU, one after the other: the KV bytes each sizes, the driver's free
    memory falling by what the first took (its context, weights and cache)."""
    sizes = []
    free = TOTAL
    for _ in range(2):
        free -= CONTEXT + weights  # this engine's context and weights, before it sizes its cache
        kv = gpu_kv_cache_bytes(TOTAL, free, weights, utilization)
        sizes.append(kv)
        free -= max(kv, 0)
    return sizes


def test_an_engine_alone_takes_its_share_less_what_it_holds_and_the_headroom():
    weights = 3 * GIB
    free = TOTAL - CONTEXT - weights
    assert gpu_kv_cache_bytes(TOTAL, free, weights, 0.9) == int(TOTAL * 0.9) - weights - _GPU_ACTIVATION_HEADROOM
    # Asked for all of it, it gets what is free.
    assert gpu_kv_cache_bytes(TOTAL, free, weights, 1.0) == free - _GPU_ACTIVATION_HEADROOM


def test_two_engines_at_half_the_default_share_each_fit_on_one_gpu_whichever_sizes_first():
    first, second = _two_engines_on_one_gpu(0.45)
    expected = int(TOTAL * 0.45) - 2 * GIB - _GPU_ACTIVATION_HEADROOM
    assert first == second == expected > 30 * GIB
    # Counting every process's memory against the share (the former sizing) left the second nothing.
    used_by_all = CONTEXT + 2 * GIB + first + CONTEXT + 2 * GIB
    assert int(TOTAL * 0.45) - used_by_all - _GPU_ACTIVATION_HEADROOM < 0


def test_two_engines_at_the_full_default_share_each_get_what_is_free_never_more():
    first, second = _two_engines_on_one_gpu(0.9)
    assert first == int(TOTAL * 0.9) - 2 * GIB - _GPU_ACTIVATION_HEADROOM
    free_for_second = TOTAL - 2 * (CONTEXT + 2 * GIB) - first
    assert second == free_for_second - _GPU_ACTIVATION_HEADROOM < first


def _runner(util: float, bytes_per_block: int = 1 << 20) -> SimpleNamespace:
    config = SimpleNamespace(num_blocks=None, gpu_memory_utilization=util, kv_cache_memory=GIB)
    return SimpleNamespace(config=config, device=torch.device("cuda", 0), bytes_per_block=bytes_per_block,
                           profile_activations=lambda: 0, tp=SINGLE)


def test_num_blocks_on_a_gpu_uses_the_driver_s_free_memory_and_torch_s_reservation(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GIB, TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * GIB)
    expected = (int(TOTAL * 0.45) - 2 * GIB - _GPU_ACTIVATION_HEADROOM) // (1 << 20)
    assert ModelRunner._num_blocks(_runner(0.45)) == expected  # type: ignore[arg-type]
    # The share is capped by what is free: another process holds the rest.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GIB, TOTAL))
    assert ModelRunner._num_blocks(_runner(0.9)) == (9 * GIB) // (1 << 20)  # type: ignore[arg-type]


def test_a_gpu_too_full_for_one_block_names_the_flag_and_the_figures(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB // 2, TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * GIB)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0.9 of 80.0 GiB.*0.50 GiB free"):
        ModelRunner._num_blocks(_runner(0.9))  # type: ignore[arg-type]


def test_a_cpu_cache_too_small_for_one_block_names_its_flag():
    runner = SimpleNamespace(config=SimpleNamespace(num_blocks=None, kv_cache_memory=1000),
                             device=torch.device("cpu"), bytes_per_block=4096)
    with pytest.raises(ValueError, match="--kv-cache-memory 1000 bytes holds no KV block"):
        ModelRunner._num_blocks(runner)  # type: ignore[arg-type]


def test_the_cache_is_sized_after_the_profiled_step_whose_cached_memory_counts_as_the_engine_s(monkeypatch):
    """The profile allocates (and leaves in torch's cache) the largest step's memory before the
    reservation is read: the cache is smaller by it, and the steps find it there."""
    reserved = {"bytes": 2 * GIB}

    def profile() -> int:
        reserved["bytes"] += 3 * GIB
        return 3 * GIB

    runner = _runner(0.45)
    runner.profile_activations = profile
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GIB, TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved["bytes"])
    expected = (int(TOTAL * 0.45) - 5 * GIB - _GPU_ACTIVATION_HEADROOM) // (1 << 20)
    assert ModelRunner._num_blocks(runner) == expected  # type: ignore[arg-type]


def test_the_profile_runs_the_largest_forward_and_samples_every_row_with_every_feature(tmp_path, monkeypatch):
    """On the CPU (where it measures nothing) the profile still runs what it would on a GPU: a forward
    over max_num_batched_tokens tokens in sequences no longer than the model's, storing nothing in the
    cache, then a sampling pass over max_num_seqs rows with every feature on, half of them seeded, the
    penalties over the longest prompt and output a request may have."""
    from transformers import LlamaConfig

    from common.config import EngineConfig
    from common.engine import model_runner
    from common.engine.sampler import Sampler
    from tests.engine.tiny_models import TINY_DIMS, build_checkpoint

    folder = build_checkpoint(LlamaConfig(**TINY_DIMS), tmp_path / "llama")
    runner = ModelRunner(EngineConfig(model=str(folder), device="cpu", dtype="float32", block_size=8, num_blocks=4,
                                      max_model_len=64, max_num_batched_tokens=150, max_num_seqs=5))
    forwards: list[tuple[list[int], list[int], list[int], list[int], int]] = []
    forward = runner.model.forward

    def spy_forward(input_ids, positions, meta, kv_cache):
        forwards.append((meta.context_lens.tolist(), meta.query_start_loc.tolist(), meta.slot_mapping.tolist(),
                         positions.tolist(), kv_cache.shape[2]))
        return forward(input_ids, positions, meta, kv_cache)

    samples = []
    sample = Sampler.sample

    def spy_sample(self, logits, requests):
        samples.append((tuple(logits.shape), [r.sampling_params for r in requests],
                        [(r.num_prompt_tokens, len(r.output_token_ids)) for r in requests]))
        return sample(self, logits, requests)

    monkeypatch.setattr(runner.model, "forward", spy_forward)
    monkeypatch.setattr(model_runner.Sampler, "sample", spy_sample)
    assert runner.profile_activations() == 0
    (lens, starts, slots, positions, cache_blocks), = forwards
    assert lens == [64, 64, 22] and starts == [0, 64, 128, 150] and slots == [-1] * 150 and cache_blocks == 1
    assert positions == [p for n in (64, 64, 22) for p in range(n)]
    (shape, params, lengths), = samples
    assert shape == (5, runner.vocab_size)
    # The penalties' token rows at their widest: a prompt, and an output, as long as a request's may be.
    assert lengths == [(62, 1), (1, 62), (16, 1), (16, 1), (16, 1)]
    assert [p.seed is not None for p in params] == [False, True, False, True, False]
    assert all(p.top_p < 1 and p.top_k > 0 and p.min_p > 0 and p.repetition_penalty != 1 and p.presence_penalty
               and p.frequency_penalty and p.logprobs == 20 for p in params)
    # Fewer sequences than that fit in max_num_seqs: the forward takes as many as there are rows.
    runner.config.max_num_seqs = 2
    forwards.clear()
    runner.profile_activations()
    assert forwards[0][0] == [64, 64]


def test_a_cache_sized_from_memory_that_cannot_hold_max_model_len_refuses_to_start(tmp_path):
    """As vLLM: a cache sized from memory (no ``--num-blocks``) must hold one request of ``max_model_len`` tokens (the
    model's own context by default); the error names both figures and the flags. Given that many blocks, or a
    shorter ``max_model_len``, the engine starts. A model windowed on every layer needs only the blocks a request of
    that length holds at once: its window and two steps' tokens."""
    from common.config import EngineConfig
    from common.engine.engine import LLMEngine
    from tests.engine.tiny_models import TINY_DIMS, build_checkpoint, family_configs

    folder = build_checkpoint(family_configs()["llama-bias"], tmp_path / "tiny")
    per_token = TINY_DIMS["num_hidden_layers"] * 2 * TINY_DIMS["num_key_value_heads"] * TINY_DIMS["head_dim"] * 4
    config = {"model": str(folder), "device": "cpu", "dtype": "float32", "block_size": 8, "num_blocks": None,
              "kv_cache_memory": 100 * 8 * per_token}  # 100 blocks: 800 tokens
    LLMEngine(EngineConfig(**config)).close()  # the model's 256 positions fit
    small = {**config, "kv_cache_memory": 20 * 8 * per_token}  # 160 tokens
    with pytest.raises(ValueError, match="holds 160 tokens \\(20 blocks of 8\\), fewer than a request of "
                                         "max_model_len 256 holds at once \\(32 blocks\\).*"
                                         "--max-model-len 160 or less.*--kv-cache-memory"):
        LLMEngine(EngineConfig(**small))
    LLMEngine(EngineConfig(**small, max_model_len=160)).close()
    LLMEngine(EngineConfig(**{**small, "num_blocks": 20})).close()
    windowed = {**small, "model": str(build_checkpoint(family_configs()["mistral-window"], tmp_path / "window"))}
    # A window of 12 and steps of 1,024 tokens: a 256-token request may still hold all its 32 blocks at once...
    with pytest.raises(ValueError, match="max_model_len 256 holds at once \\(32 blocks\\)"):
        LLMEngine(EngineConfig(**windowed))
    # ... in steps of 16 at most, 12 + 2 x 16 - 2 keys span 6 blocks of 8 at most: 20 blocks are plenty.
    LLMEngine(EngineConfig(**windowed, max_num_batched_tokens=16)).close()


def test_a_model_of_ten_million_positions_is_refused_or_served_without_a_table_of_them(tmp_path):
    """Llama 4 Scout's context is 10M positions. A cache that cannot hold one request that long is refused by the
    capacity check, as above. Given the blocks (``--num-blocks``), the engine serves the model at its full
    ``max_model_len``. Nothing the model holds grows with its positions: RoPE's cos and sin come from each step's
    positions, not from a table over all of them. Its greedy tokens equal those of the same weights with 256
    positions."""
    from common.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.engine.request import SamplingParams
    from tests.engine.tiny_models import TINY_DIMS, build_checkpoint, family_configs, prompt_token_ids

    short = build_checkpoint(family_configs()["llama-bias"], tmp_path / "short")
    config = family_configs()["llama-bias"]
    config.max_position_embeddings = 10_000_000
    long = build_checkpoint(config, tmp_path / "long")
    per_token = TINY_DIMS["num_hidden_layers"] * 2 * TINY_DIMS["num_key_value_heads"] * TINY_DIMS["head_dim"] * 4
    base = {"device": "cpu", "dtype": "float32", "block_size": 8, "max_num_seqs": 2}
    with pytest.raises(ValueError, match="max_model_len 10000000 holds at once \\(1250000 blocks\\)"):
        LLMEngine(EngineConfig(model=str(long), num_blocks=None, kv_cache_memory=100 * 8 * per_token, **base))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = prompt_token_ids(40)
    outputs = []
    for folder in (short, long):
        engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, **base))
        try:
            model = engine.runner.model
            assert engine.runner.max_model_len == (256 if folder == short else 10_000_000)
            assert sum(b.numel() for b in model.buffers()) < 1_000, "a buffer grows with the model's positions"
            outputs.append(engine.generate([prompt], greedy)[0][0])
        finally:
            engine.close()
    assert outputs[0] == outputs[1]
