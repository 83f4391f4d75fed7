"""Command line of the router: ``python -m common.cli router ...`` ends up in ``main``."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from common.cli import HF_OVERRIDES_HELP, hf_overrides_arg
from common.cluster_key import add_cluster_key_args, cluster_key_from_args
from common.gc_pacer import GcPacer, GcPauses
from common.lora_modules import lora_module_arg
from ops.supervisor import die_with_parent
from router import harmony
from router.auth import keys_from_env
from router.config import RequestLimits, RouterConfig
from router.http_options import add_http_args, check_http_args, uvicorn_options, wrap_app
from router.image_fetch import DEFAULT_FETCH_TIMEOUT_S, fetch_timeout_arg
from router.images import (
    DEFAULT_CACHE_GB,
    DEFAULT_MAX_IMAGES_PER_PROMPT,
    limit_mm_per_prompt_arg,
    mm_processor_cache_gb_arg,
    mm_processor_kwargs_arg,
)
from router.reasoning import REASONING_PARSERS
from router.routing import POLICIES
from router.sampling_defaults import SamplingDefaults, generation_config_arg
from router.tool_parsers import PARSERS

logger = logging.getLogger("router")
# uvloop's event loop and httptools' HTTP/1.1 protocol (uvicorn's h11 one frames each chunk in Python):
# less router CPU per streamed token at hundreds of streams (README, router overhead).
UVICORN_SETTINGS: dict[str, Any] = {"loop": "uvloop", "http": "httptools"}


def build_parser() -> argparse.ArgumentParser:
    defaults = RouterConfig(served_model_names=["-"])
    p = argparse.ArgumentParser(prog="pdserve router", description="OpenAI-compatible router")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--workers", type=int, default=1,
        help="router processes serving --port together (SO_REUSEPORT: the kernel spreads connections); "
        "each has its own reply socket (--reply-port, when set, counts up per worker), registry view, "
        "admission queue and /metrics (default: %(default)s)",
    )
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set on each worker
    p.add_argument("--redis-url", default=defaults.redis_url, help="registry and prefix index")
    p.add_argument("--namespace", default=defaults.namespace, help="key prefix in Redis")
    p.add_argument("--model", default=None, help="model name or checkpoint folder (default model if unset)")
    p.add_argument("--hf-overrides", default=None, type=hf_overrides_arg, metavar="JSON", help=HF_OVERRIDES_HELP)
    p.add_argument("--served-model-name", nargs="+", default=None, help="names clients use for the model")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="vLLM's flag: the sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
                   "max_new_tokens) of requests that leave them unset: the model's generation_config.json (auto), "
                   "OpenAI's (vllm), or that of another folder (default: %(default)s)")
    p.add_argument("--override-generation-config", default=None, type=generation_config_arg, metavar="JSON",
                   help="vLLM's flag: generation config keys set over those of --generation-config, e.g. "
                   '{"temperature": 0.5}')
    p.add_argument("--lora-modules", nargs="+", default=[], type=lora_module_arg, metavar="NAME=PATH",
                   help="the engines' LoRA adapters (their --lora-modules): a request naming one as its model "
                   "runs with it; /v1/models lists them under the base model")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded "
                   "into (and unloaded from) every engine's free --max-loras slots at run time, from paths on the "
                   "engines' hosts (behind the API keys; keep it off where clients are not trusted with that)")
    p.add_argument("--api-key", action="append", default=[], help="repeatable; also env PDSERVE_API_KEYS")
    p.add_argument("--routing-policy", choices=POLICIES, default=defaults.routing_policy)
    p.add_argument(
        "--prefix-alpha", type=float, default=defaults.prefix_alpha, help="load weight of 'prefix'"
    )
    p.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    p.add_argument("--max-inflight", type=int, default=defaults.max_inflight,
                   help="HTTP requests served at once; past it a 429 (0: unlimited)")
    p.add_argument(
        "--max-requests-per-instance",
        type=int,
        default=defaults.max_requests_per_instance,
        help="engine requests (one per prompt) this router keeps at each decode instance at once; the rest "
        "wait in its fair queue, one client after another; about twice the engines' --max-num-seqs keeps "
        "them busy (default: %(default)s)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=defaults.max_waiting_requests,
        help="engine requests waiting in the fair queue; past it a 429 with Retry-After (default: %(default)s)",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=int,
        default=defaults.max_queued_tokens,
        help="prompt tokens waiting in the fair queue; past it a 429 with Retry-After (default: %(default)s)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=defaults.request_timeout_s, help="seconds between outputs"
    )
    p.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=defaults.engine_stall_timeout_s,
        help="seconds without progress from an instance before its requests continue elsewhere",
    )
    p.add_argument(
        "--reply-host",
        default=defaults.reply_host,
        help="address engines use to reach the router ('auto': own IP)",
    )
    p.add_argument("--reply-port", type=int, default=defaults.reply_port, help="0: any free port")
    add_cluster_key_args(p)
    p.add_argument(
        "--direct-prompt-tokens",
        type=int,
        default=defaults.direct_prompt_tokens,
        help="prompts shorter than this skip prefill instances (0: one block, -1: never)",
    )
    limits = RequestLimits()
    p.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=limits.max_prompts_per_request,
        help="most prompts in one /v1/completions 'prompt' list (default: %(default)s, as vLLM)",
    )
    p.add_argument(
        "--max-n",
        type=int,
        default=limits.max_n,
        help="largest 'n' (choices per prompt) a request may ask for (default and most: %(default)s)",
    )
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="as the engines': with priority, a request's 'priority' (lower first) orders it in their "
        "queues; with fcfs (the default) a nonzero one gets a 400",
    )
    p.add_argument(
        "--max-stop-strings",
        type=int,
        default=limits.max_stop_strings,
        help="most 'stop' strings in one request (default: %(default)s, as OpenAI and vLLM)",
    )
    p.add_argument(
        "--max-stop-string-chars",
        type=int,
        default=limits.max_stop_string_chars,
        help="longest 'stop' string in characters (default: %(default)s)",
    )
    p.add_argument(
        "--max-total-tokens-per-request",
        type=int,
        default=limits.max_total_tokens_per_request,
        help="most output tokens one request may ask for, n x prompts x max_tokens (a prompt without "
        "max_tokens counts the room left in its context); 0: unlimited (default: %(default)s, so any "
        "one prompt with the largest n fits a 128k context)",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        type=limit_mm_per_prompt_arg,
        default=DEFAULT_MAX_IMAGES_PER_PROMPT,
        metavar="JSON",
        help='vLLM\'s flag: the images one chat prompt may hold, e.g. {"image": 4}, for a model that takes '
        "images; other modalities are not served (default: %(default)s images)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        metavar="HOST",
        help="vLLM's flag: the hosts whose http(s) image URLs the router fetches (exact host names); none by "
        "default, so only inline data URLs are taken",
    )
    p.add_argument(
        "--mm-processor-cache-gb",
        type=mm_processor_cache_gb_arg,
        default=DEFAULT_CACHE_GB,
        metavar="GIB",
        help="vLLM's flag: GiB of processed images (by the bytes they came in) each router process keeps, so a "
        "conversation's images are not processed again every turn; 0: none (default: %(default)s)",
    )
    p.add_argument(
        "--mm-processor-kwargs",
        type=mm_processor_kwargs_arg,
        default=None,
        metavar="JSON",
        help="vLLM's flag: the image processor's settings for every request (a request's mm_processor_kwargs "
        'override them), e.g. {"max_pixels": 1003520} for Qwen-VL; names and bounds checked against the model',
    )
    p.add_argument(
        "--media-fetch-timeout",
        type=fetch_timeout_arg,
        default=DEFAULT_FETCH_TIMEOUT_S,
        help="seconds a fetch of an image URL may take, redirects included (default: %(default)s, vLLM's)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="chat template to use instead of the tokenizer's: a Jinja file, or one shipped with the router "
        "by name (chatml-tools: ChatML with tools in the Hermes format)",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "none", *PARSERS, harmony.TOOL_CALL_PARSER],
        help="how tool calls are read out of the model's answers for tool_choice 'auto' (openai: gpt-oss's harmony "
        "format); auto: found from the chat template's tool-call format (none if it has none) (default: %(default)s)",
    )
    p.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="taken for vLLM's command lines: tool_choice 'auto' is served wherever the chat template shows the "
        "model its tools and a parser reads their calls, with or without it",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=[*REASONING_PARSERS, harmony.REASONING_PARSER],
        help="split a reasoning model's thinking (<think>...</think>) into reasoning_content: deepseek_r1 "
        "(DeepSeek-R1 and its distillations, QwQ), qwen3, or deepseek_v3 / glm45 / kimi_k2 / minimax_m2 (where the "
        "prompt opened the thinking, as deepseek_r1, else as qwen3) (default: not split); a chat template in gpt-oss's "
        "harmony format (openai_gptoss) is always split by its channels",
    )
    p.add_argument(
        "--response-ttl", type=int, default=defaults.response_ttl_s,
        help="seconds a Responses API response asked to be stored (store, true by default) is kept in "
        "Redis, for previous_response_id and GET /v1/responses/{id}; 0: none is stored (default: %(default)s)",
    )
    p.add_argument(
        "--response-store-url", default=None,
        help="the Redis that keeps stored responses, apart from the registry's (default: --redis-url)",
    )
    p.add_argument(
        "--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"]
    )
    add_http_args(p)
    return p


def _served_name(model: str | None, model_dir: pathlib.Path) -> str:
    """The name given on the command line, else the checkpoint's own name."""
    from common.model.loader import served_model_name

    if model and not pathlib.Path(model).exists():
        return model
    return served_model_name(model_dir)


# The router's paced collections: young ones whose survivors are frozen, each once 2,000 young
# objects or 0.1 s of allocations have gathered (``common/gc_pacer.py``), so each pause is a tenth
# of what a collection a second cost.
ROUTER_GC_DUE_OBJECTS = 2_000
ROUTER_GC_MAX_INTERVAL_S = 0.1


def router_gc_pacer(clock: Callable[[], float] = time.monotonic) -> GcPacer:
    return GcPacer(due_objects=ROUTER_GC_DUE_OBJECTS, max_interval_s=ROUTER_GC_MAX_INTERVAL_S,
                   freeze_survivors=True, clock=clock)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.workers < 1:
        raise SystemExit("--workers must be at least 1")
    check_http_args(args)
    if args.workers > 1:
        if args.port == 0:
            raise SystemExit("--workers > 1 needs a fixed --port")
        return run_workers(argv, args)
    # Before anything loads: a missing key on a public reply address fails start-up at once.
    cluster_key = cluster_key_from_args(args, args.reply_host, "router")

    import uvicorn

    from common.model.loader import (
        headless_architecture,
        model_identity,
        overridden_model,
        resolve_model_path,
    )
    from router.app import create_app
    from router.image_fetch import ImageFetcher
    from router.images import MAX_ENCODED_IMAGE_BYTES, ModelImages
    from router.pooling import PoolingConfig
    from router.state import RouterState
    from router.tokenization import PromptProcessor, load_chat_template
    from router.tool_parsers import detect_parser

    source_dir = resolve_model_path(args.model)
    model_dir = overridden_model(source_dir, args.hf_overrides) if args.hf_overrides else source_dir
    try:
        prompts = PromptProcessor.from_model_dir(model_dir, load_chat_template(args.chat_template))
    except ValueError as exc:
        raise SystemExit(f"--chat-template: {exc}") from None
    tool_call_parser = args.tool_call_parser
    if tool_call_parser == "auto":
        tool_call_parser = (harmony.TOOL_CALL_PARSER if harmony.writes_harmony(prompts.template_text())
                            else detect_parser(prompts.template_text()))
    try:
        harmony.check_parsers(prompts.template_text(), tool_call_parser, args.reasoning_parser)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    try:
        pooling = PoolingConfig.from_model_dir(model_dir)
    except ValueError as exc:
        raise SystemExit(f"the model's sentence-transformers config: {exc}") from None
    try:
        fetcher = ImageFetcher(args.allowed_media_domains, args.media_fetch_timeout, MAX_ENCODED_IMAGE_BYTES)
        images = ModelImages.from_model_dir(model_dir, prompts.tokenizer, fetcher,
                                            int(args.mm_processor_cache_gb * (1 << 30)), args.mm_processor_kwargs)
    except ValueError as exc:
        raise SystemExit(f"the model's image processor: {exc}") from None
    if images.processor is not None:
        logger.info("images: taken in user messages, at most %d per prompt (--limit-mm-per-prompt)",
                    args.limit_mm_per_prompt)
    try:
        sampling_defaults = SamplingDefaults.load(args.generation_config, model_dir, args.override_generation_config)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if described := sampling_defaults.describe():
        logger.info("sampling defaults of requests that leave them unset, from the generation config: %s", described)
    config = RouterConfig(
        pooling=pooling,
        images=images,
        sampling_defaults=sampling_defaults,
        headless_architecture=headless_architecture(json.loads((model_dir / "config.json").read_text())),
        model_identity=model_identity(model_dir),
        served_model_names=args.served_model_name or [_served_name(args.model, source_dir)],
        lora_modules=args.lora_modules,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        redis_url=args.redis_url or None,
        namespace=args.namespace,
        api_keys=[*args.api_key, *keys_from_env()],
        routing_policy=args.routing_policy,
        prefix_alpha=args.prefix_alpha,
        max_body_bytes=args.max_body_bytes,
        max_inflight=args.max_inflight,
        max_requests_per_instance=args.max_requests_per_instance,
        max_waiting_requests=args.max_waiting_requests,
        max_queued_tokens=args.max_queued_tokens,
        request_timeout_s=args.request_timeout,
        engine_stall_timeout_s=args.engine_stall_timeout,
        reply_host=args.reply_host,
        reply_port=args.reply_port,
        cluster_key=cluster_key,
        tool_call_parser=None if tool_call_parser == "none" else tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        response_ttl_s=args.response_ttl,
        response_store_url=args.response_store_url,
        direct_prompt_tokens=args.direct_prompt_tokens,
        limits=RequestLimits(
            max_prompts_per_request=args.max_prompts_per_request,
            max_n=args.max_n,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_chars=args.max_stop_string_chars,
            max_total_tokens_per_request=args.max_total_tokens_per_request,
            priority_scheduling=args.scheduling_policy == "priority",
            max_images_per_prompt=args.limit_mm_per_prompt,
        ),
    )
    state = RouterState(config, prompts)
    logger.info(
        "serving %s from %s on http://%s:%d", config.served_model_names, model_dir, args.host, args.port
    )
    logger.info("tools: %s; tool-call parser: %s",
                "shown to the model" if prompts.renders_tools else "not rendered by the chat template (refused)",
                config.tool_call_parser or "none")
    app = create_app(state)
    # What start-up built (tokenizer, app) lives as long as the process: collections skip it, and run
    # less often; the per-token path allocates many short-lived objects, few of them in cycles. Where
    # the router has a quiet moment (an engine message's outputs all sent), they run then
    # (``common/gc_pacer.py``).
    gc.collect()
    gc.freeze()
    pacer = router_gc_pacer()
    pacer.install()
    state.client.gc_pacer = pacer
    GcPauses(state.metrics.observe_gc_pause, pacer)
    served, options = wrap_app(app, args), uvicorn_options(args)
    if not args.reuse_port:
        uvicorn.run(served, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                    **UVICORN_SETTINGS, **options)
        return 0
    server = uvicorn.Server(uvicorn.Config(served, log_level=args.log_level, access_log=False, **UVICORN_SETTINGS,
                                           **options))
    server.run(sockets=[_reuse_port_socket(args.host, args.port)])
    return 0


def _reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening address several processes bind at once; the kernel spreads new connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run_workers(argv: list[str], args: argparse.Namespace) -> int:
    """``--workers N``: N router processes on one port, each a plain router with ``--reuse-port``.

    They share nothing but Redis (engines answer each on its own reply socket). This process only
    watches them: SIGTERM / SIGINT is passed on, and when one worker exits the others are stopped
    and the exit code is passed up, so a supervisor (``pdserve up``) restarts the whole router."""
    workers = []
    for index in range(args.workers):
        extra = ["--workers", "1", "--reuse-port"]
        if args.reply_port:
            extra += ["--reply-port", str(args.reply_port + index)]
        command = [sys.executable, "-m", "common.cli", "router", *argv, *extra]
        workers.append(subprocess.Popen(command, preexec_fn=die_with_parent))
    logger.info("router: %d worker processes on port %d: pids %s", len(workers), args.port,
                [w.pid for w in workers])

    def forward(signum: int, _: object) -> None:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = 0
    try:
        while all(w.poll() is None for w in workers):
            time.sleep(0.2)
        code = next(w.returncode for w in workers if w.returncode is not None)
        if code:
            logger.error("a router worker exited with code %d; stopping the others", code)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
    return code


if __name__ == "__main__":
    sys.exit(main())
