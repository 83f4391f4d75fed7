"""Decode steps through ``DecodeGraphs``' static, padded buffers give what the eager forward gives.

Capture and replay need a GPU (``pdserve bench gpu`` runs them, graphs on and off); here the same
padded static-buffer forward runs eagerly (``capture=False``), which is what a graph records: the
padding rows (slot -1, context 0, token 0) must change no real row, with the torch kernels on the
default model and with the Triton kernels (the ones a graph captures) on a tiny one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from common.engine.engine import LLMEngine
from common.engine.input_batch import BatchInputs
from common.sampling_params import SamplingParams
from tests.engine import tiny_models
from tests.engine.conftest import hf_greedy, prompt_ids


def test_graph_batch_sizes_cover_every_batch_up_to_the_largest() -> None:
    assert graph_batch_sizes(512) == [1, 2, 4, 8, *range(16, 513, 16)]
    assert graph_batch_sizes(1000) == graph_batch_sizes(512)  # at most 512
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]  # the largest batch has its own
    assert graph_batch_sizes(3) == [1, 2, 3]
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)


def _use_padded_path(engine: LLMEngine, sizes: list[int]) -> list[int]:
    """Gives ``engine``'s runner the padded static-buffer decode path (run eagerly); returns a list
    that collects each replayed step's (real) batch size."""
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_cache, sizes, runner.input_batch.block_table.shape[1],
                          capture=False, lora=runner.lora)
    runs: list[int] = []
    run = graphs.run

    def counting(inputs: BatchInputs, lora_select: torch.Tensor | None = None) -> torch.Tensor:
        runs.append(inputs.context_lens.shape[0])
        return run(inputs, lora_select)

    graphs.run = counting  # type: ignore[method-assign]
    runner.decode_graphs = graphs
    return runs


def test_padded_decode_steps_equal_transformers_on_the_default_model(engine_factory) -> None:  # type: ignore[no-untyped-def]
    engine = engine_factory(block_size=16, max_num_batched_tokens=512)
    runs = _use_padded_path(engine, [1, 2, 4, 8])
    prompts = [list(p) for p in prompt_ids()[:5]]
    # Different lengths: the batch shrinks 5 -> 3 -> 1, padded to 8, then 4, then 1 (no padding).
    lengths = [24, 16, 16, 8, 8]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    got = [choices[0] for choices in engine.generate(prompts, params)]
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        assert got[i] == list(hf_greedy(tuple(prompt), n)), f"prompt {i}"
    # Every decode step replayed (the prefill step did not), at every batch size the run went through.
    assert set(runs) == {5, 3, 1} and len(runs) == max(lengths) - 1


@pytest.mark.parametrize("family", ["llama-bias", "qwen2-moe-shared-expert", "glm4-moe-partial-rope-groups",
                                    "gpt-oss-moe-sinks-window", "ernie4_5-moe-interleaved-rope-shared",
                                    "cohere2-interleaved-rope-window", "gpt-neox-parallel-two-norms",
                                    "olmo-layernorm-no-weights-clip-qkv", "persimmon-qk-layernorm-partial-rope-relu2",
                                    "falcon-new-arch-grouped-qkv-two-norms", "llama4-moe-chunked-nope-qk-norm"])
def test_padded_decode_steps_with_the_triton_kernels_equal_eager(tmp_path: Path, engine_factory, family: str) -> None:  # type: ignore[no-untyped-def]
    """The kernels a graph captures (through Triton's interpreter here): stores skipped for slot -1,
    an empty context's attention, the full-width block table; a mixture's experts grouped on the device
    (padding rows routed too, changing no real row); GLM-4.5's partial RoPE and sigmoid router; gpt-oss's
    sinks in the attention kernels, its experts' biases and activation; ERNIE 4.5's reordered q and k rows
    and its corrected softmax router; Cohere 2's LayerNorm kernel, side-by-side blocks and unrotated layers;
    GPT-NeoX's LayerNorms with a bias, a norm of its own for the MLP, and its partial RoPE; OLMo 1's LayerNorms
    met with ones, its clamped q, k and v rotated against float32 tables; Persimmon's q/k LayerNorms with a bias;
    Falcon's q/k/v split by kv head; Llama 4's chunked attention (prompts and decodes across chunks), its
    weightless q/k norms and its experts' scaled inputs."""
    folder = tiny_models.build_checkpoint(tiny_models.family_configs()[family], tmp_path / "tiny")
    prompts = [tiny_models.prompt_token_ids(n, seed=n) for n in (5, 19, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # Transformers' greedy output is the reference: a run whose every decode step is padded, equal to it, is equal to
    # the unpadded one wherever that is right (its prompts run unpadded through the same kernels); one engine, not
    # two compared, halves the interpreter's time.
    engine = engine_factory(model=str(folder), block_size=8, num_blocks=64, kernel_backend="triton", max_model_len=64)
    runs = _use_padded_path(engine, [4])
    outputs = [c[0] for c in engine.generate(prompts, params)]
    assert len(runs) == 9
    assert outputs == [tiny_models.hf_greedy(folder, p, 10) for p in prompts]


def _inputs(num_seqs: int, tokens_per_seq: int = 1, width: int = 2) -> BatchInputs:
    n = num_seqs * tokens_per_seq
    return BatchInputs(
        input_ids=torch.zeros(n, dtype=torch.long), positions=torch.zeros(n, dtype=torch.long),
        slot_mapping=torch.zeros(n, dtype=torch.long), block_tables=torch.zeros(num_seqs, width, dtype=torch.int32),
        query_start_loc=torch.arange(0, n + 1, tokens_per_seq, dtype=torch.int32),
        context_lens=torch.ones(num_seqs, dtype=torch.int32), max_query_len=tokens_per_seq,
        sample_idx=torch.arange(num_seqs),
    )


def test_only_decode_steps_within_the_largest_graph_and_its_width_replay() -> None:
    graphs = DecodeGraphs(torch.nn.Identity(), torch.zeros(1, 2, 4, 8, 1, 4), [1, 2, 4], 3, capture=False)
    assert [graphs.padded_size(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    assert graphs.fits(_inputs(3))
    assert not graphs.fits(_inputs(5))  # more sequences than the largest graph
    assert not graphs.fits(_inputs(2, tokens_per_seq=3))  # a prefill chunk
    assert not graphs.fits(_inputs(2, width=4))  # a table wider than the static one
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(torch.nn.Identity(), torch.zeros(1), [1], 1)  # capture on the CPU
    with pytest.raises(ValueError, match="ascending"):
        DecodeGraphs(torch.nn.Identity(), torch.zeros(1), [4, 2], 1, capture=False)


def test_loading_a_step_pads_the_rows_after_it() -> None:
    graphs = DecodeGraphs(torch.nn.Identity(), torch.zeros(1, 2, 4, 8, 1, 4), [1, 2, 4], 3, capture=False)
    graphs.slot_mapping.fill_(7)  # what an earlier, larger step left
    graphs.context_lens.fill_(9)
    step = _inputs(3)
    step.input_ids += 5
    step.slot_mapping += 11
    step.block_tables[:] = torch.tensor([[3, 4]], dtype=torch.int32)
    graphs.load(step, 4)
    assert graphs.input_ids.tolist() == [5, 5, 5, 0]
    assert graphs.slot_mapping.tolist() == [11, 11, 11, -1]  # the padding row stores nothing
    assert graphs.context_lens.tolist() == [1, 1, 1, 0]  # and attends to nothing
    assert graphs.block_tables[:3, :2].tolist() == [[3, 4]] * 3


def test_enforce_eager_is_a_flag_and_the_cpu_runs_eagerly(engine_factory) -> None:  # type: ignore[no-untyped-def]
    import argparse

    from common.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(["--enforce-eager"])).enforce_eager
    assert not EngineConfig.from_cli_args(parser.parse_args([])).enforce_eager
    assert engine_factory().runner.decode_graphs is None  # no CUDA: nothing captured


def test_a_prefill_instance_captures_no_graphs_a_decode_instance_does() -> None:
    """A prefill instance runs prompt chunks and their first token, no decode step: it is eager
    whatever the flags say; a decode instance follows ``--enforce-eager``."""
    import argparse

    from common.service import add_service_args
    from decode_svc.service import DecodeService
    from prefill_svc.service import PrefillService

    def args(role: str, *flags: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_service_args(parser, role)
        return parser.parse_args(list(flags))

    assert PrefillService.engine_config(args("prefill")).enforce_eager
    assert not DecodeService.engine_config(args("decode")).enforce_eager
    assert DecodeService.engine_config(args("decode", "--enforce-eager")).enforce_eager
