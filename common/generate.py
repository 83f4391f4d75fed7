"""``pdserve generate``: the engine in one process, for a prompt or a JSONL file of requests.

JSONL input: one object a line with ``prompt`` (text) or ``messages`` (chat) or
``prompt_token_ids``, and any sampling field (``max_tokens``, ``temperature``, ``seed``, ...).
Output: one object a line per choice with ``id``, ``index``, ``text`` and ``token_ids``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import msgspec

from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.sampling_params import SamplingParams

_PARAM_FIELDS = set(SamplingParams.__struct_fields__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--input", help="JSONL file of requests ('-' for standard input)")
    parser.add_argument("--output", default="-", help="JSONL output for --input (default: standard output)")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template to --prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print JSON with the token ids")
    parser.add_argument("--lora-name", default=None,
                        help="run the prompts with this adapter of --lora-modules (an --input line's "
                        "\"lora_name\" chooses its own)")
    EngineConfig.add_cli_args(parser, include_seed=False)
    return parser


def _encode(tokenizer: Any, item: dict[str, Any], chat: bool) -> list[int]:
    if "prompt_token_ids" in item:
        return [int(t) for t in item["prompt_token_ids"]]
    messages = item.get("messages")
    text = item.get("prompt")
    if messages is None and chat and isinstance(text, str):
        messages = [{"role": "user", "content": text}]
    if messages is not None:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    if not isinstance(text, str):
        raise ValueError("each request needs 'prompt', 'messages' or 'prompt_token_ids'")
    return list(tokenizer(text).input_ids)


def _params(item: dict[str, Any], defaults: dict[str, Any]) -> SamplingParams:
    fields = {**defaults, **{k: v for k, v in item.items() if k in _PARAM_FIELDS}}
    try:
        return msgspec.convert(fields, SamplingParams)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    engine = LLMEngine(EngineConfig.from_cli_args(argparse.Namespace(**{**vars(args), "seed": args.seed or 0})))
    try:
        return _run(args, engine)
    finally:
        engine.close()  # a tensor-parallel engine's other ranks


def _run(args: argparse.Namespace, engine: LLMEngine) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(engine.runner.model_path))
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "seed": args.seed, "n": args.n}
    if args.prompt is not None:
        items = [{"prompt": args.prompt}]
    else:
        stream = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")  # noqa: SIM115
        with stream:
            items = [json.loads(line) for line in stream if line.strip()]
    prompts, plist, loras = [], [], []
    for i, item in enumerate(items):
        try:
            prompts.append(_encode(tokenizer, item, args.chat))
            p = _params(item, defaults)
            engine.validate(prompts[-1], p)
            plist.append(p)
            loras.append(item.get("lora_name", args.lora_name))
            engine.lora_slot(loras[-1])
        except ValueError as exc:
            print(f"error: request {i}: {exc}", file=sys.stderr)
            return 2
    results = engine.generate(prompts, plist, loras)
    records = []
    for i, (item, choices) in enumerate(zip(items, results, strict=True)):
        for j, token_ids in enumerate(choices):
            records.append({
                "id": item.get("id", i), "index": j, "text": tokenizer.decode(token_ids, skip_special_tokens=True),
                "token_ids": token_ids, "prompt_tokens": len(prompts[i]),
            })
    if args.prompt is not None and not args.json:
        for r in records:
            print(r["text"])
        return 0
    out = sys.stdout if args.output == "-" or args.prompt is not None else open(args.output, "w", encoding="utf-8")  # noqa: SIM115
    for r in records:
        out.write(json.dumps(r) + "\n")
    if out is not sys.stdout:
        out.close()
    return 0
