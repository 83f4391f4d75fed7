"""Sliding-window Mistral, Qwen3, Mixtral (a mixture of experts) and Cohere 2 tiny checkpoints through the real commands: the greedy tokens of
``pdserve generate`` (a subprocess) and of ``pdserve up`` (redis-server, router, prefill and decode
processes; the prompt is long enough that the router sends it prefill -> KV transfer -> decode) equal
transformers ``generate`` on the same checkpoint, over a prompt several windows long."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import collect_lines, free_port
from tests.engine.tiny_models import (
    WINDOW,
    build_checkpoint,
    build_tokenizer,
    family_configs,
    hf_greedy,
    prompt_token_ids,
)
from tests.router.router_harness import wait_until

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
# Sliding window on every layer (Mistral); Qwen3 with q/k norms, biases and windowed / full layers;
# Mixtral: Mistral's attention with 2 of 4 experts in every layer.
# Cohere 2: RoPE over interleaved pairs (q and k rows reordered as the checkpoint loads: the K sent between
# processes in that order), LayerNorms, attention and MLP side by side, its global layers unrotated.
MODELS = ["mistral-window", "qwen3-layer-types-bias", "mixtral-moe-window", "cohere2-interleaved-rope-window"]
BLOCK_SIZE = 8
PROMPT_LEN = 3 * WINDOW + 9  # 45 tokens: past three windows, ending inside a block
MAX_TOKENS = 8
# Prefill chunks of 20 tokens end inside blocks and windows; 64 blocks are plenty for a few requests.
ENGINE_FLAGS = ["--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", "20", "--num-blocks", "64"]
BOS = 1  # what the tiny tokenizer puts before a text prompt


@dataclass(frozen=True)
class TinyModel:
    name: str
    folder: Path
    prompt_token_ids: list[int]
    expected: list[int]  # transformers' greedy tokens for prompt_token_ids, EOS ignored


@pytest.fixture(scope="module", params=MODELS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    name: str = request.param
    folder = build_checkpoint(family_configs()[name], tmp_path_factory.mktemp(name))
    build_tokenizer(folder)
    prompt = prompt_token_ids(PROMPT_LEN)
    return TinyModel(name, folder, prompt, hf_greedy(folder, prompt, MAX_TOKENS))


def test_the_window_changes_transformers_output_on_this_prompt(tiny: TinyModel) -> None:
    """Guards the tests below: with full attention the same weights give other tokens."""
    from transformers import AutoConfig

    full = AutoConfig.from_pretrained(str(tiny.folder))
    full.sliding_window = 10_000
    full.layer_types = ["full_attention"] * full.num_hidden_layers
    assert hf_greedy(tiny.folder, tiny.prompt_token_ids, MAX_TOKENS, config=full) != tiny.expected


def test_pdserve_generate_greedy_equals_transformers(tiny: TinyModel, tmp_path: Path) -> None:
    text = " ".join(f"w{t}" for t in tiny.prompt_token_ids)  # the word-level tokenizer's spelling
    requests = [
        {"id": "ids", "prompt_token_ids": tiny.prompt_token_ids, "max_tokens": MAX_TOKENS, "ignore_eos": True},
        {"id": "text", "prompt": text, "max_tokens": MAX_TOKENS, "ignore_eos": True},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in requests), encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "common.cli", "generate", "--model", str(tiny.folder), "--device", "cpu",
         "--dtype", "float32", "--input", str(src), "--output", str(dst), *ENGINE_FLAGS],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    records = {r["id"]: r for r in map(json.loads, dst.read_text(encoding="utf-8").splitlines())}
    assert records["ids"]["token_ids"] == tiny.expected
    assert records["text"]["prompt_tokens"] == PROMPT_LEN + 1
    assert records["text"]["token_ids"] == hf_greedy(tiny.folder, [BOS, *tiny.prompt_token_ids], MAX_TOKENS)


@dataclass
class UpStack:
    proc: subprocess.Popen[str]
    url: str
    stderr: list[str]


@contextlib.contextmanager
def running_up(argv: list[str]) -> Iterator[UpStack]:
    """``pdserve up`` with ``argv`` (its port given by ``--port``) until ready; SIGTERM at the end must
    stop it cleanly."""
    port = argv[argv.index("--port") + 1]
    proc = subprocess.Popen([sys.executable, "-m", "common.cli", "up", *argv], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stdout, stderr = collect_lines(proc.stdout), collect_lines(proc.stderr)
    try:
        ready = wait_until(lambda: proc.poll() is not None or any("ready at" in line for line in stdout), 200)
        assert ready and proc.poll() is None, "".join(stdout + stderr)
        yield UpStack(proc, f"http://127.0.0.1:{port}", stderr)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "".join(stderr)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def up_argv(folder: Path, log_dir: Path, *flags: str) -> list[str]:
    """One prefill and one decode instance on ``folder``, on a free port, float32 on the CPU."""
    return ["--prefill", "1", "--decode", "1", "--model", str(folder), "--port", str(free_port()),
            "--threads-per-engine", "1", "--grace-period", "10", "--ready-timeout", "180", "--log-dir", str(log_dir),
            "--device", "cpu", "--dtype", "float32", *flags]


@pytest.fixture(scope="module")
def up(tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    """``pdserve up --prefill 1 --decode 1`` on the tiny checkpoint, one per model for the module."""
    with running_up(up_argv(tiny.folder, tmp_path_factory.mktemp(f"up-{tiny.name}"), *ENGINE_FLAGS)) as stack:
        yield stack


def _routed(url: str) -> dict[str, float]:
    """The router's count of engine requests by path (direct to decode, or disaggregated)."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve:router_requests_routed_total{"):
            key, _, value = line.rpartition(" ")
            counts[key.split('path="', 1)[1].split('"', 1)[0]] = float(value)
    return counts


def test_pdserve_up_greedy_equals_transformers_through_prefill_transfer_decode(tiny: TinyModel, up: UpStack) -> None:
    from transformers import AutoTokenizer

    before = _routed(up.url)
    body = {"prompt": tiny.prompt_token_ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    response = httpx.post(f"{up.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "length"
    # Each token of the word-level vocabulary has its own string, so the logprobs name the token ids.
    tokens = choice["logprobs"]["tokens"]
    got = AutoTokenizer.from_pretrained(str(tiny.folder)).convert_tokens_to_ids(tokens)
    assert got == tiny.expected, "".join(up.stderr)
    after = _routed(up.url)
    assert after.get("disaggregated", 0) == before.get("disaggregated", 0) + 1, (before, after)
    assert after.get("direct", 0) == before.get("direct", 0), "the prompt skipped the prefill instance"
