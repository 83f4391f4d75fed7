"""The KV cache's size on a GPU: this engine's share of the GPU, less what it holds, never more than
is free; two engines on one GPU fit when their shares do. Run on the CPU with the CUDA memory queries
answered by the test (``_num_blocks`` reads nothing else of the GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.engine.model_runner import _GPU_ACTIVATION_HEADROOM, ModelRunner, gpu_kv_cache_bytes

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
    return SimpleNamespace(config=config, device=torch.device("cuda", 0), bytes_per_block=bytes_per_block)


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
