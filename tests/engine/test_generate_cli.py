"""``pdserve generate`` end to end in a subprocess: greedy tokens as transformers gives them, JSONL in and
out, and a bad request rejected with exit code 2 and the field named on stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.engine.conftest import PROMPTS, hf_greedy, tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "common.cli", "generate", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )


def _json_lines(text: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_generate_prompt_json_prints_the_transformers_greedy_tokens():
    prompt = "The capital of France is"
    proc = _generate("--prompt", prompt, "--max-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    (record,) = _json_lines(proc.stdout)
    ids = tuple(tokenizer()(prompt).input_ids)
    assert record["token_ids"] == list(hf_greedy(ids, 8))[:8]
    assert record["prompt_tokens"] == len(ids) and record["index"] == 0
    assert record["text"] == tokenizer().decode(record["token_ids"], skip_special_tokens=True)


def test_generate_jsonl_in_gives_one_line_per_choice_in_order(tmp_path):
    requests = [
        {"id": "a", "prompt": "Write a haiku about the ocean.", "max_tokens": 6},
        {"id": "b", "prompt_token_ids": [504, 3575, 282, 4649, 314], "max_tokens": 4, "ignore_eos": True},
        {"id": "c", "prompt": "def fibonacci(n):", "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 3},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in requests) + "\n", encoding="utf-8")
    proc = _generate("--input", str(src), "--output", str(dst))
    assert proc.returncode == 0, proc.stderr
    records = _json_lines(dst.read_text(encoding="utf-8"))
    assert [(r["id"], r["index"]) for r in records] == [("a", 0), ("b", 0), ("c", 0), ("c", 1)]
    a_ids = tuple(tokenizer()(requests[0]["prompt"]).input_ids)
    assert records[0]["token_ids"] == list(hf_greedy(a_ids, 6))[:6]
    assert records[1]["token_ids"] == list(hf_greedy((504, 3575, 282, 4649, 314), 4))
    assert all(len(r["token_ids"]) <= 5 for r in records[2:])


def test_generate_bad_request_exits_2_naming_the_field(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(
        json.dumps({"prompt": "Hello", "max_tokens": 4}) + "\n"
        + json.dumps({"prompt": "Hello", "max_tokens": 4, "top_p": 1.5}) + "\n",
        encoding="utf-8",
    )
    proc = _generate("--input", str(src), "--output", str(dst))
    assert proc.returncode == 2
    assert "top_p" in proc.stderr and "request 1" in proc.stderr
    assert not dst.exists(), "nothing is written when a request is rejected"


def test_generate_with_ngram_drafts_gives_the_transformers_greedy_tokens_and_refuses_other_methods(tmp_path):
    prompt = PROMPTS[6]  # a sentence six times: its output repeats it, so drafts are kept
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": prompt, "max_tokens": 24, "ignore_eos": True}) + "\n", encoding="utf-8")
    proc = _generate("--input", str(src), "--output", str(dst), "--speculative-config", spec)
    assert proc.returncode == 0, proc.stderr
    (record,) = _json_lines(dst.read_text(encoding="utf-8"))
    assert record["token_ids"] == list(hf_greedy(tuple(tokenizer()(prompt).input_ids), 24))
    proc = _generate("--prompt", prompt, "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}')
    assert proc.returncode == 2 and "'eagle' is not implemented" in proc.stderr



def test_generate_with_a_lora_adapter_gives_pefts_greedy_tokens_and_refuses_an_unknown_one(tmp_path):
    from tests.engine.conftest import model_path
    from tests.engine.tiny_models import peft_adapter, peft_greedy

    adapter = peft_adapter(Path(model_path()), tmp_path / "adapter", r=8, lora_alpha=16, scale=2.0,
                           target_modules=["v_proj", "o_proj", "up_proj", "down_proj"])
    prompt = "The capital of France is"
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"prompt": prompt, "max_tokens": 8, "ignore_eos": True},
             {"prompt": prompt, "max_tokens": 8, "ignore_eos": True, "lora_name": None}]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    proc = _generate("--input", str(src), "--output", str(dst), "--enable-lora", "--lora-modules",
                     f"sql={adapter}", "--lora-name", "sql")
    assert proc.returncode == 0, proc.stderr
    adapted, base = _json_lines(dst.read_text(encoding="utf-8"))
    ids = tokenizer()(prompt).input_ids
    assert adapted["token_ids"] == peft_greedy(Path(model_path()), adapter, ids, 8)
    assert base["token_ids"] == list(hf_greedy(tuple(ids), 8)) != adapted["token_ids"]
    proc = _generate("--prompt", prompt, "--enable-lora", "--lora-modules", f"sql={adapter}", "--lora-name", "nope")
    assert proc.returncode == 2 and "unknown LoRA adapter 'nope' (served here: sql)" in proc.stderr
