"""``--kv-cache-dtype fp8`` through the real commands: ``pdserve up`` (redis-server, router, a prefill
and a decode process, the 8-bit blocks over the KV transfer's sockets) answers with the greedy tokens
that ``pdserve generate`` gives with the same 8-bit cache in one process, over a prompt several sliding
windows long; both engines log the 8-bit cache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import collect_lines, free_port
from tests.e2e.test_model_families_cli import ENGINE_FLAGS, MAX_TOKENS, PROMPT_LEN, ROOT, _routed
from tests.engine.tiny_models import build_checkpoint, build_tokenizer, family_configs, prompt_token_ids
from tests.router.router_harness import wait_until

pytestmark = pytest.mark.timeout(300)

FP8_FLAGS = [*ENGINE_FLAGS, "--kv-cache-dtype", "fp8"]


def test_pdserve_up_with_fp8_caches_answers_what_one_engine_answers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = build_checkpoint(family_configs()["mistral-window"], tmp_path / "tiny")
    build_tokenizer(folder)
    prompt = prompt_token_ids(PROMPT_LEN)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt_token_ids": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}) + "\n")
    generated = subprocess.run(
        [sys.executable, "-m", "common.cli", "generate", "--model", str(folder), "--device", "cpu", "--dtype",
         "float32", "--input", str(src), "--output", str(dst), *FP8_FLAGS],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
    )
    assert generated.returncode == 0, generated.stderr
    expected = json.loads(dst.read_text())["token_ids"]
    assert len(expected) == MAX_TOKENS

    port = free_port()
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "common.cli", "up", "--prefill", "1", "--decode", "1", "--model", str(folder),
         "--port", str(port), "--threads-per-engine", "1", "--grace-period", "10", "--ready-timeout", "180",
         "--log-dir", str(logs), "--device", "cpu", "--dtype", "float32", *FP8_FLAGS],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = collect_lines(proc.stdout), collect_lines(proc.stderr)
    try:
        ready = wait_until(lambda: proc.poll() is not None or any("ready at" in line for line in stdout), 200)
        assert ready and proc.poll() is None, "".join(stdout + stderr)
        url = f"http://127.0.0.1:{port}"
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        tokens = response.json()["choices"][0]["logprobs"]["tokens"]
        assert AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids(tokens) == expected
        assert _routed(url).get("disaggregated", 0) == 1, "the prompt skipped the prefill instance"
        engine_logs = [p.read_text() for p in logs.glob("*.log") if p.name.startswith(("prefill", "decode"))]
        assert len(engine_logs) == 2 and all("float8_e4m3fn" in log for log in engine_logs), engine_logs
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "".join(stderr)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
