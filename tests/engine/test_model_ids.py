"""``--model org/name``: found in the local Hugging Face cache (a fake one built here, with a tiny
model), served under its id, and refused clearly (saying where it looked) when offline and missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.generate import main as generate_main
from common.model.loader import resolve_model_path, served_model_name
from router.main import _served_name
from tests.engine.tiny_models import build_checkpoint, build_tokenizer, family_configs, hf_greedy

REPO_ID = "tiny-org/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline Hugging Face cache holding ``REPO_ID`` at ``COMMIT`` (refs/main -> snapshot)."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    build_checkpoint(family_configs()["qwen3-layer-types-bias"], snapshot)
    build_tokenizer(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_model_id_resolves_from_the_local_cache_and_is_served_under_the_id(hf_cache: Path) -> None:
    path = resolve_model_path(REPO_ID)
    assert path == hf_cache / "models--tiny-org--tiny-qwen3" / "snapshots" / COMMIT
    assert served_model_name(path) == REPO_ID
    assert _served_name(REPO_ID, path) == REPO_ID  # the router's default --served-model-name


def test_pdserve_generate_runs_a_cached_model_id_greedy_equal_to_transformers(
    hf_cache: Path, tmp_path: Path
) -> None:
    prompt_ids = [5, 17, 99, 3, 42, 8, 61, 23, 77, 12, 4, 90, 31, 56, 7, 19, 64, 28, 11, 83]  # past the window
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": " ".join(f"w{i}" for i in prompt_ids), "ignore_eos": True}) + "\n")
    argv = ["--model", REPO_ID, "--input", str(src), "--output", str(dst), "--max-tokens", "8",
            "--block-size", "8", "--num-blocks", "32", "--device", "cpu", "--dtype", "float32"]
    assert generate_main(argv) == 0
    (record,) = [json.loads(line) for line in dst.read_text().splitlines()]
    assert record["prompt_tokens"] == len(prompt_ids) + 1  # the tokenizer adds <s>
    assert record["token_ids"] == hf_greedy(resolve_model_path(REPO_ID), [1, *prompt_ids], 8)


def test_a_missing_model_id_offline_says_where_it_looked(hf_cache: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path("tiny-org/not-there")
    message = str(info.value)
    assert "'tiny-org/not-there'" in message and "offline" in message
    assert str(hf_cache / "models--tiny-org--not-there") in message


def test_a_cached_id_without_a_snapshot_is_treated_as_missing(hf_cache: Path) -> None:
    repo = hf_cache / "models--tiny-org--broken"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)  # the ref, but no snapshot folder
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache"):
        resolve_model_path("tiny-org/broken")


def test_names_that_are_neither_a_folder_nor_an_id_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="Hugging Face model id"):
        resolve_model_path("no-slash-name")


def test_online_a_missing_id_is_downloaded_into_the_cache_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub itself is out of reach here: ``snapshot_download`` is replaced by a fake hub."""
    import huggingface_hub

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    calls: list[dict[str, object]] = []

    def fake_snapshot_download(repo_id: str, **kwargs: object) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        repo = "models--" + repo_id.replace("/", "--")
        snapshot = Path(str(kwargs["cache_dir"])) / repo / "snapshots" / COMMIT
        if kwargs.get("local_files_only"):
            if not snapshot.exists():
                raise FileNotFoundError("not cached")
            return str(snapshot)
        if repo_id != "tiny-org/fresh":
            raise OSError("404 Client Error: Repository Not Found")
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text("{}")
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    path = resolve_model_path("tiny-org/fresh")
    assert path.parent.parent.parent == cache and served_model_name(path) == "tiny-org/fresh"
    assert [c.get("local_files_only", False) for c in calls] == [True, False]
    assert "*.safetensors" in calls[1]["allow_patterns"]  # type: ignore[operator]
    assert resolve_model_path("tiny-org/fresh") == path and len(calls) == 3  # cached now: no download
    with pytest.raises(FileNotFoundError, match="could not be downloaded: OSError: 404"):
        resolve_model_path("tiny-org/missing")


def test_a_conversion_parses_a_gguf_file_once_and_leaves_gguf_as_it_found_it(tmp_path: Path) -> None:
    """transformers opens the file for the tokenizer, the config and the weights: one reader serves
    all three, and one tensor-name map serves every module; gguf's own functions come back after."""
    import gguf
    import numpy as np

    from common.model.loader import _gguf_parsed_once

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader_type, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first
        assert [t.name for t in first.tensors] == ["token_embd.weight"]
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is reader_type and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(path) is not first
