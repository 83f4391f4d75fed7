"""``pdserve bench lora``: a short run on the default model reports every run beside the base model's,
the adapters change the tokens, and a mixed batch gives each request its adapter's tokens."""

from __future__ import annotations

import json
from pathlib import Path

from ops.bench import lora


def test_a_short_run_reports_each_run_and_equal_tokens(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    assert lora.main(["--num-prompts", "3", "--max-tokens", "8", "--batch", "3", "--num-adapters", "2", "--rank", "4",
                      "--cost-batches", "8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["run"] for r in result["runs"]] == ["no-lora", "base", "one", "mixed"]
    for r in result["runs"]:
        assert r["output_tokens"] == 24 and r["tokens_per_s"] > 0
    assert result["mixed_equal_alone"] is True and result["base_equal_no_lora"] is True
    (cost,) = result["grouping_host_time"]
    assert cost["batch"] == 8 and cost["group_ms_per_step"] > 0


def test_the_written_adapters_change_the_tokens(tmp_path: Path) -> None:
    from common.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.lora_modules import LoRAModule
    from common.model.loader import resolve_model_path
    from common.model.weights import load_hf_config
    from common.sampling_params import SamplingParams

    folder = lora.write_adapter(tmp_path / "a", load_hf_config(resolve_model_path(None)), rank=4, seed=0)
    engine = LLMEngine(EngineConfig(device="cpu", num_blocks=64, enable_lora=True,
                                    lora_modules=(LoRAModule("a", str(folder)),)))
    prompt = [1, 504, 2365, 6354, 16438, 27003, 690, 260]
    base, adapted = (engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), [name])[0][0]
                     for name in (None, "a"))
    assert base != adapted
