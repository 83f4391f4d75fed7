"""``--kv-cache-dtype fp8`` (and ``fp8_e5m2``) through the real commands: ``pdserve up`` (redis-server, router, a prefill
and a decode process, the 8-bit blocks over the KV transfer's sockets) answers with the greedy tokens
that ``pdserve generate`` gives with the same 8-bit cache in one process, over a prompt several sliding
windows long; both engines log the 8-bit cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_model_families_cli import (
    ENGINE_FLAGS,
    MAX_TOKENS,
    PROMPT_LEN,
    ROOT,
    _routed,
    running_up,
    up_argv,
)
from tests.engine.tiny_models import build_checkpoint, build_tokenizer, family_configs, prompt_token_ids

pytestmark = pytest.mark.timeout(300)

@pytest.mark.parametrize(("kv", "dtype"), [("fp8", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")])
def test_pdserve_up_with_fp8_caches_answers_what_one_engine_answers(tmp_path: Path, kv: str, dtype: str) -> None:
    from transformers import AutoTokenizer

    folder = build_checkpoint(family_configs()["mistral-window"], tmp_path / "tiny")
    build_tokenizer(folder)
    prompt = prompt_token_ids(PROMPT_LEN)
    flags = [*ENGINE_FLAGS, "--kv-cache-dtype", kv]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt_token_ids": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}) + "\n")
    generated = subprocess.run(
        [sys.executable, "-m", "common.cli", "generate", "--model", str(folder), "--device", "cpu", "--dtype",
         "float32", "--input", str(src), "--output", str(dst), *flags],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
    )
    assert generated.returncode == 0, generated.stderr
    expected = json.loads(dst.read_text())["token_ids"]
    assert len(expected) == MAX_TOKENS

    logs = tmp_path / "logs"
    with running_up(up_argv(folder, logs, *flags)) as stack:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        tokens = response.json()["choices"][0]["logprobs"]["tokens"]
        assert AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids(tokens) == expected
        assert _routed(stack.url).get("disaggregated", 0) == 1, "the prompt skipped the prefill instance"
        engine_logs = [p.read_text() for p in logs.glob("*.log") if p.name.startswith(("prefill", "decode"))]
        assert len(engine_logs) == 2 and all(dtype in log for log in engine_logs), engine_logs
