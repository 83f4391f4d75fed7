"""``pdserve up``: the whole stack on one machine (Redis, prefill and decode engines, the router).

Resolves the model once (so a conversion happens once, not in every child), starts a private
``redis-server`` without persistence, then the services as child processes, waits until the
router's /ready answers 200 and prints the URL. Arguments it does not know are passed on to the
engines (``--drain-timeout`` among them).

It supervises (``ops.supervisor``): a child that dies is restarted with the same argv, environment,
instance id and ports after an exponential back-off, one stderr line per death and per restart.
It gives up, stops everything and exits non-zero only when the router crash-loops
(``--max-restarts`` deaths in a row within ``--restart-window`` of starting), or when any child
does so before the stack was first ready (never, with ``--no-wait``), so a broken model or flag
still fails start-up. With ``--log-dir DIR`` it keeps ``DIR/children.json`` (pid, restarts and role
by name) current. Ctrl-C / SIGTERM stops router, engines, then Redis: SIGTERM, and SIGKILL after
``--grace-period`` (long enough for the engines to drain).

On a GPU host each engine gets a GPU of its own while there are enough, round-robin after that
(``CUDA_VISIBLE_DEVICES`` per engine), and engines sharing a GPU split the default memory share
(``place_engines``).

Every run makes a fresh cluster key and gives it to each child (``PDSERVE_CLUSTER_KEY``), so the
internal planes are authenticated without any setup; a key already in the environment
(``PDSERVE_CLUSTER_KEY`` or ``PDSERVE_CLUSTER_KEY_FILE``) is used instead, for engines started elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from common.cli import HF_OVERRIDES_HELP, hf_overrides_arg
from common.cluster_key import ENV_KEY, ClusterKey
from common.glibc_env import tuned_env
from common.lora_modules import lora_module_arg
from ops.supervisor import Child, ChildExited, RestartPolicy, Supervisor
from ops.supervisor import die_with_parent as die_with_parent  # re-exported: tests start children with it
from router.http_options import add_http_args, check_http_args, http_flags
from router.image_fetch import fetch_timeout_arg
from router.images import limit_mm_per_prompt_arg, mm_processor_cache_gb_arg, mm_processor_kwargs_arg
from router.sampling_defaults import generation_config_arg

POLL_S = 0.2
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # the engines' own default (``EngineConfig``), shared out here

ENGINE_FLAGS = ("block_size", "kv_cache_memory", "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens",
                "max_model_len", "scheduling_policy", "tensor_parallel_size", "quantization")


def _generation_config_text(text: str) -> str:
    """``--override-generation-config``, checked here and given to the router as it was written."""
    generation_config_arg(text)
    return text


def _limit_mm_text(text: str) -> str:
    """``--limit-mm-per-prompt``, checked here and given to the router as it was written."""
    limit_mm_per_prompt_arg(text)
    return text


def _mm_processor_kwargs_text(text: str) -> str:
    """``--mm-processor-kwargs``, checked as JSON here and given to the router as it was written (the router
    checks its settings against the model)."""
    mm_processor_kwargs_arg(text)
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve up", description="Run Redis, engines and the router locally.")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill instances")
    p.add_argument("--decode", type=int, default=1, help="number of decode instances")
    p.add_argument("--model", default=None, help="checkpoint folder, .gguf file, or the default model's name")
    p.add_argument("--hf-overrides", default=None, type=hf_overrides_arg, metavar="JSON",
                   help=HF_OVERRIDES_HELP + ": given to the router and every engine")
    p.add_argument("--host", default="127.0.0.1", help="the router's HTTP host")
    p.add_argument("--port", type=int, default=8000, help="the router's HTTP port")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    p.add_argument("--block-size", type=int)
    p.add_argument("--kv-cache-memory")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="every engine's KV cache dtype (fp8: half a 16-bit cache's memory; auto: the model's)")
    p.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                   help="the checkpoint's quantization, checked by every engine against its config")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="every engine's model split over this many processes (on a GPU host, that many GPUs each: "
                   "engine after engine, as many as there are groups of them)")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="the decode instances' --stream-interval: tokens per message to the router")
    p.add_argument("--speculative-config", default=None,
                   help="the decode instances' --speculative-config (n-gram drafts), e.g. "
                   '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
    p.add_argument("--enable-lora", action="store_true", help="every engine serves the LoRA adapters of --lora-modules")
    p.add_argument("--lora-modules", nargs="+", default=[], type=lora_module_arg, metavar="NAME=PATH",
                   help="PEFT LoRA adapters (name=path, or vLLM's JSON form) every engine serves and the router "
                   "names: a request selects one by its name as the model")
    p.add_argument("--max-loras", type=int, default=None, help="the engines' --max-loras")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="the router serves POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with "
                   "--enable-lora, and --max-loras above the --lora-modules for slots to load into)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="the engines' --max-lora-rank")
    p.add_argument("--threads-per-engine", type=int, default=0,
                   help="torch CPU threads of each engine (0: the host's cores shared out, or OMP_NUM_THREADS)")
    p.add_argument("--api-key", action="append", default=[], help="router API key (repeatable)")
    p.add_argument("--routing-policy", default=None, help="router policy: prefix, least-loaded, round-robin")
    p.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"],
                   help="the engines' and the router's: priority orders requests by their 'priority'")
    p.add_argument("--router-workers", type=int, default=1,
                   help="router processes behind --port (the router's --workers; default: %(default)s)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--chat-template", default=None,
                   help="the router's --chat-template: a Jinja file, or a shipped one's name (chatml-tools)")
    p.add_argument("--tool-call-parser", default=None,
                   help="the router's --tool-call-parser (default: found from the chat template)")
    p.add_argument("--reasoning-parser", default=None, help="the router's --reasoning-parser (deepseek_r1, qwen3, deepseek_v3, glm45, kimi_k2, minimax_m2, openai_gptoss)")
    p.add_argument("--generation-config", default=None, metavar="auto|vllm|FOLDER",
                   help="the router's --generation-config: sampling defaults from the model's generation_config.json "
                   "(auto, the default), OpenAI's (vllm), or another folder's")
    p.add_argument("--override-generation-config", default=None, type=_generation_config_text, metavar="JSON",
                   help="the router's --override-generation-config")
    p.add_argument("--limit-mm-per-prompt", default=None, type=_limit_mm_text, metavar="JSON",
                   help='the router\'s --limit-mm-per-prompt: images one chat prompt may hold, e.g. {"image": 4}')
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="the router's --allowed-media-domains: hosts whose http(s) image URLs it fetches")
    p.add_argument("--mm-processor-cache-gb", default=None, type=mm_processor_cache_gb_arg, metavar="GIB",
                   help="the router's --mm-processor-cache-gb: GiB of processed images each router process keeps")
    p.add_argument("--mm-processor-kwargs", default=None, type=_mm_processor_kwargs_text, metavar="JSON",
                   help='the router\'s --mm-processor-kwargs: the image processor\'s settings for every request, e.g. '
                   '{"max_pixels": 1003520}')
    p.add_argument("--media-fetch-timeout", default=None, type=fetch_timeout_arg,
                   help="the router's --media-fetch-timeout (seconds)")
    p.add_argument("--response-ttl", type=int, default=None,
                   help="the router's --response-ttl: seconds a stored Responses API response is kept (0: none)")
    p.add_argument("--enable-auto-tool-choice", action="store_true", help="the router's (taken for vLLM's command "
                   "lines: tool_choice 'auto' is served wherever the chat template shows the tools)")
    add_http_args(p)  # the router's HTTP front door: CORS, HTTPS, request ids
    p.add_argument("--no-wait", action="store_true", help="do not wait for /ready before printing the URL")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for /ready")
    p.add_argument("--grace-period", type=float, default=40.0,
                   help="seconds between SIGTERM and SIGKILL (engines drain for --drain-timeout first)")
    p.add_argument("--log-dir", default=None,
                   help="write each child's output to DIR/NAME.log and their pids to DIR/children.json")
    p.add_argument("--restart-delay", type=float, default=1.0,
                   help="first back-off before restarting a dead child; doubles per death, up to 30s")
    p.add_argument("--restart-window", type=float, default=60.0,
                   help="a child up this long has its back-off reset; a shorter run counts towards a crash loop")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts in a row of a child that dies within --restart-window before giving up "
                        "(the router always, any child before the stack was ready)")
    p.add_argument(
        "--service-command",
        default=f"{shlex.quote(sys.executable)} -m common.cli",
        help="command that runs one service given its role and flags",
    )
    return p


def visible_gpus(env: Mapping[str, str], count_gpus: Callable[[], int]) -> list[str]:
    """The GPUs the engines may use, each as ``CUDA_VISIBLE_DEVICES`` names it: that variable's entries
    where it is set (up to the first empty or negative one, as CUDA reads it: "" or "-1" hides every
    GPU), else ``count_gpus()`` indices (``nvml_gpu_count``: none on a host without a driver)."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count_gpus())]
    gpus: list[str] = []
    for entry in (e.strip() for e in listed.split(",")):
        if not entry or entry.startswith("-"):
            break
        gpus.append(entry)
    return gpus


def nvml_gpu_count() -> int:
    """GPUs the driver sees (NVML, which needs no CUDA context and no torch); 0 without one."""
    from common.nvml_metrics import load_nvml

    nvml = load_nvml()
    if nvml is None:
        return 0
    try:
        return int(nvml.nvmlDeviceGetCount())
    finally:
        nvml.nvmlShutdown()


def place_engines(names: list[str], gpus: list[str], per_engine: int = 1) -> dict[str, tuple[str, float]]:
    """Engine name -> (its ``CUDA_VISIBLE_DEVICES``, its share of that GPU's memory): each engine on a
    GPU of its own while there are enough, round-robin after that; engines on one GPU split the
    default utilisation evenly (two on one: 0.45 each), as two vLLM servers on one GPU must be told.
    ``per_engine``: GPUs each engine takes (its tensor-parallel ranks), consecutive ones, in groups that
    the engines share out as single GPUs are; fewer GPUs than one engine needs are refused."""
    if not gpus:
        return {}
    if len(gpus) < per_engine:
        raise ValueError(f"--tensor-parallel-size {per_engine} needs {per_engine} GPUs per engine; "
                         f"{len(gpus)} visible ({','.join(gpus)})")
    groups = [",".join(gpus[i : i + per_engine]) for i in range(0, len(gpus) - per_engine + 1, per_engine)]
    on = {name: groups[i % len(groups)] for i, name in enumerate(names)}
    sharing = Counter(on.values())
    return {name: (gpu, math.floor(DEFAULT_GPU_MEMORY_UTILIZATION / sharing[gpu] * 100) / 100)
            for name, gpu in on.items()}


# Ports the launcher hands its children start here: below the kernel's ephemeral range, above the
# ranges the test suite's first five workers take theirs from (tests/conftest.py).
PORT_FLOOR = 20_000


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default where unreadable)."""
    try:
        with open(path, encoding="ascii") as f:
            low, high = (int(field) for field in f.read().split())
    except (OSError, ValueError):
        return 32_768, 60_999
    return low, high


def free_port(rng: random.Random | None = None, ephemeral: tuple[int, int] | None = None) -> int:
    """A loopback port that is free now, for a child to bind later.

    ``bind(0)`` would hand out a port from the ephemeral range, which any outgoing connection on the
    host may be given before the child binds it (an engine then dies on "Address already in use",
    and its restart on the same port can fail again). So the port is drawn at random between
    ``PORT_FLOOR`` and the start of that range, where the kernel hands nothing out by itself, and
    kept only if it binds; ``bind(0)`` only where that range leaves no room."""
    low = (ephemeral or ephemeral_ports())[0]
    rng = rng or random.SystemRandom()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        for _ in range(200 if low - PORT_FLOOR >= 1_000 else 0):
            try:
                sock.bind(("127.0.0.1", rng.randrange(PORT_FLOOR, low)))
            except OSError:
                continue
            return int(sock.getsockname()[1])
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Launcher:
    def __init__(self, args: argparse.Namespace, engine_extra: list[str]) -> None:
        self.args = args
        self.engine_extra = engine_extra
        policy = RestartPolicy(
            initial_delay_s=args.restart_delay, window_s=args.restart_window, max_restarts=args.max_restarts
        )
        self.supervisor = Supervisor(policy, args.log_dir)
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-")
        self.stopping = False
        self.metrics_urls: dict[str, str] = {}  # engine name -> its /metrics
        self.ever_ready = False  # once true, only the router's crash loop stops the stack
        self.cluster_env, self.cluster_key_origin = cluster_env(os.environ)

    @property
    def children(self) -> list[Child]:
        return self.supervisor.children

    def request_stop(self, signum: int, _frame: Any) -> None:
        self.stopping = True

    # -- starting ------------------------------------------------------------------------------
    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        """Start a supervised child; its role is its name up to the first ``-`` (``prefill-0``: prefill)."""
        return self.supervisor.start(name, name.partition("-")[0], argv, env or {})

    def start_redis(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found: install Redis or pass --redis-url")
        port = free_port()
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.spawn("redis", [*argv, "--dir", self._tmp.name, "--loglevel", "warning"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=0.5) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return f"redis://127.0.0.1:{port}/0"
            self.poll_children()
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING within 10s")

    def engine_flags(self) -> list[str]:
        flags = []
        for name in ENGINE_FLAGS:
            value = getattr(self.args, name)
            if value is not None:
                flags += [f"--{name.replace('_', '-')}", str(value)]
        if self.args.enable_lora:
            flags.append("--enable-lora")
        if self.args.lora_modules:
            flags += ["--lora-modules", *(m.to_arg() for m in self.args.lora_modules)]
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self.args, name) is not None:
                flags += [f"--{name.replace('_', '-')}", str(getattr(self.args, name))]
        return [*flags, *self.model_flags(), *self.engine_extra]

    def model_flags(self) -> list[str]:
        """What every service needs to see the same model: ``--hf-overrides``."""
        overrides = self.args.hf_overrides
        return [] if overrides is None else ["--hf-overrides", json.dumps(overrides)]

    def router_flags(self) -> list[str]:
        flags = [arg for key in self.args.api_key for arg in ("--api-key", key)]
        flags += self.model_flags()
        if self.args.routing_policy:
            flags += ["--routing-policy", self.args.routing_policy]
        if self.args.scheduling_policy:
            flags += ["--scheduling-policy", self.args.scheduling_policy]
        if self.args.served_model_name:
            flags += ["--served-model-name", self.args.served_model_name]
        if self.args.lora_modules:
            flags += ["--lora-modules", *(m.to_arg() for m in self.args.lora_modules)]
        if self.args.allow_runtime_lora_updating:
            flags.append("--allow-runtime-lora-updating")
        if self.args.router_workers != 1:
            flags += ["--workers", str(self.args.router_workers)]
        if self.args.response_ttl is not None:
            flags += ["--response-ttl", str(self.args.response_ttl)]
        for name in ("chat_template", "tool_call_parser", "reasoning_parser", "generation_config",
                     "override_generation_config", "limit_mm_per_prompt", "mm_processor_kwargs"):
            value = getattr(self.args, name)
            if value:
                flags += [f"--{name.replace('_', '-')}", value]
        if self.args.allowed_media_domains:
            flags += ["--allowed-media-domains", *self.args.allowed_media_domains]
        if self.args.media_fetch_timeout is not None:
            flags += ["--media-fetch-timeout", str(self.args.media_fetch_timeout)]
        if self.args.mm_processor_cache_gb is not None:
            flags += ["--mm-processor-cache-gb", str(self.args.mm_processor_cache_gb)]
        if self.args.enable_auto_tool_choice:
            flags.append("--enable-auto-tool-choice")
        return [*flags, *http_flags(self.args)]

    def engine_env(self) -> dict[str, str]:
        """What the engines get beyond this environment: CPU threads and C-library settings.

        Torch CPU threads per engine: the cores shared out, so engines on one host do not
        oversubscribe. An explicit ``--threads-per-engine`` or ``OMP_NUM_THREADS`` wins. (On a
        GPU the engines hardly use CPU threads, and fewer of them only cut contention, as in
        vLLM's workers.) ``GLIBC_TUNABLES``: see ``common.glibc_env``.
        """
        env = tuned_env(os.environ)
        threads = self.args.threads_per_engine
        if threads == 0:
            if "OMP_NUM_THREADS" in os.environ:
                return env
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            ranks = (self.args.prefill + self.args.decode) * (self.args.tensor_parallel_size or 1)
            threads = max(1, cores // max(1, ranks))
        return {**env, "OMP_NUM_THREADS": str(threads)}

    def engines(self) -> list[tuple[str, str]]:
        """(name, role) of every engine, prefill first."""
        return [(f"{role}-{i}", role) for role, count in (("prefill", self.args.prefill), ("decode", self.args.decode))
                for i in range(count)]

    def gpu_placement(self) -> dict[str, tuple[str, float]]:
        """Where each engine runs on a GPU host (``place_engines`` over ``visible_gpus``); {} on a CPU
        host or where the engines were told ``--device``. With ``--gpu-memory-utilization`` given,
        the engines get that value as it is."""
        if any(arg == "--device" or arg.startswith("--device=") for arg in self.engine_extra):
            return {}
        return place_engines([name for name, _ in self.engines()], visible_gpus(os.environ, nvml_gpu_count),
                             self.args.tensor_parallel_size or 1)

    def start_all(self, model: str) -> None:
        redis_url = self.args.redis_url or self.start_redis()
        service = shlex.split(self.args.service_command)
        engine_env = {**self.engine_env(), **self.cluster_env}
        placement = self.gpu_placement()
        user_share = any(arg.startswith("--gpu-memory-utilization") for arg in self.engine_extra)
        for name, role in self.engines():
            ports = [str(free_port()) for _ in range(3)]
            argv = [*service, role, "--model", model, "--redis-url", redis_url, "--host", "127.0.0.1"]
            argv += ["--port", ports[0], "--kv-port", ports[1], "--metrics-port", ports[2]]
            if role == "decode" and self.args.stream_interval is not None:
                argv += ["--stream-interval", str(self.args.stream_interval)]
            if role == "decode" and self.args.speculative_config is not None:
                argv += ["--speculative-config", self.args.speculative_config]
            env = engine_env
            if name in placement:
                gpu, share = placement[name]
                env = {**engine_env, "CUDA_VISIBLE_DEVICES": gpu}
                if not user_share:
                    argv += ["--gpu-memory-utilization", str(share)]
                print(f"pdserve: {name} on GPU {gpu}" + ("" if user_share else f", {share:g} of its memory"),
                      file=sys.stderr, flush=True)
            self.spawn(name, [*argv, "--instance-id", name, *self.engine_flags()], env)
            self.metrics_urls[name] = f"http://127.0.0.1:{ports[2]}/metrics"
        argv = [*service, "router", "--model", model, "--redis-url", redis_url]
        self.spawn(
            "router",
            [*argv, "--host", self.args.host, "--port", str(self.args.port), *self.router_flags()],
            self.cluster_env,
        )

    # -- watching ------------------------------------------------------------------------------
    def poll_children(self) -> None:
        """Restart what died (see ``Supervisor.poll``); raise ``ChildExited`` when the stack cannot go on."""
        self.supervisor.poll(lambda child: child.role == "router" or not self.ever_ready)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.args.host in ("0.0.0.0", "::", "") else self.args.host
        return f"{'https' if self.args.ssl_certfile else 'http'}://{host}:{self.args.port}"

    @property
    def _ready_context(self) -> ssl.SSLContext | None:
        """For an HTTPS router, what its readiness is read with: the router is this launcher's own child on a
        local address, and a certificate made for the host's public name would not match it, so none is
        checked here (clients check it)."""
        if not self.args.ssl_certfile:
            return None
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.args.ready_timeout
        while time.monotonic() < deadline and not self.stopping:
            self.poll_children()
            with (
                contextlib.suppress(urllib.error.URLError, OSError, ValueError),
                urllib.request.urlopen(f"{self.url}/ready", timeout=2, context=self._ready_context) as response,
            ):
                body = json.loads(response.read())
                # /ready is 200 once one decode instance serves; wait for every instance launched.
                if body.get("prefill", 0) >= self.args.prefill and body.get("decode", 0) >= self.args.decode:
                    self.ever_ready = True
                    return
            time.sleep(POLL_S)
        if not self.stopping:
            raise TimeoutError(
                f"the stack was not ready after {self.args.ready_timeout:.0f}s (GET {self.url}/ready)"
            )

    def supervise(self) -> None:
        """Until Ctrl-C / SIGTERM: restart children that die; ``ChildExited`` if the router crash-loops."""
        while not self.stopping:
            self.poll_children()
            time.sleep(POLL_S)

    # -- stopping ------------------------------------------------------------------------------
    def stop_all(self) -> None:
        """Router first, then engines, then Redis: SIGTERM, wait the grace period, SIGKILL."""
        router = [c for c in self.children if c.role == "router"]
        redis = [c for c in self.children if c.role == "redis"]
        engines = [c for c in self.children if c not in router and c not in redis]
        for group in (router, engines, redis):
            self._stop_group(group)
        self._tmp.cleanup()

    def _stop_group(self, group: list[Child]) -> None:
        for child in group:
            if child.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.grace_period
        for child in group:
            try:
                child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"pdserve: {child.name} did not stop in time; killing it", file=sys.stderr)
                child.popen.kill()
                child.popen.wait()


def cluster_env(environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """What the router and engines get on top of ``environ`` for the cluster key, and where it came
    from: nothing when ``environ`` already names a key (they inherit it), else a fresh one."""
    try:
        inherited = ClusterKey.load(environ=environ)
    except ValueError as exc:
        raise SystemExit(f"pdserve up: bad cluster key: {exc}") from None
    if inherited is not None:
        return {}, "the cluster key from the environment"
    return {ENV_KEY: ClusterKey.generate().secret_text}, "a fresh cluster key"


def _resolve_model(model: str | None) -> str:
    from common.model.loader import resolve_model_path

    return str(resolve_model_path(model))


def check_engine_flags(flags: list[str]) -> None:
    """``SystemExit`` naming what an engine would refuse in ``flags`` (``EngineConfig``'s flags and checks; the
    others, a service's own, are left to it): argparse's for a value of the wrong form, else the config's reason."""
    from common.config import EngineConfig

    parser = argparse.ArgumentParser(prog="pdserve up (engine flags)", add_help=False, allow_abbrev=False)
    EngineConfig.add_cli_args(parser)
    known, _ = parser.parse_known_args(flags)
    try:
        EngineConfig.from_cli_args(known)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["up"]:
        argv = argv[1:]
    args, engine_extra = build_parser().parse_known_args(argv)
    if args.prefill < 0 or args.decode < 1:
        raise SystemExit("need --decode >= 1 and --prefill >= 0")
    check_http_args(args)  # here, not by the router's crash loop
    if args.threads_per_engine < 0:
        raise SystemExit("need --threads-per-engine >= 0")
    if args.restart_delay <= 0 or args.restart_window <= 0 or args.max_restarts < 0:
        raise SystemExit("need --restart-delay > 0, --restart-window > 0 and --max-restarts >= 0")
    if args.speculative_config is not None:  # refused here, not by a decode instance's crash loop
        from common.config import SpeculativeConfig

        try:
            SpeculativeConfig.parse(args.speculative_config)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    launcher = Launcher(args, engine_extra)
    # Refused here, naming the flag, not by every engine's crash loop: the flags as the engines read them, and the
    # adapters' folders.
    spec = [] if args.speculative_config is None else ["--speculative-config", args.speculative_config]
    check_engine_flags([*launcher.engine_flags(), *spec])
    if args.lora_modules:
        from common.model.lora import check_adapter_folder

        try:
            for module in args.lora_modules:
                check_adapter_folder(module)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    print("pdserve: resolving the model (converted once, then cached)...", flush=True)
    model = _resolve_model(args.model)
    try:
        launcher.gpu_placement()  # enough GPUs for each engine's ranks
    except ValueError as e:
        raise SystemExit(str(e)) from None
    signal.signal(signal.SIGINT, launcher.request_stop)
    signal.signal(signal.SIGTERM, launcher.request_stop)
    exit_code = 0
    print(
        "pdserve: internal planes (engine control, replies, KV transfer, registry entries) are "
        f"authenticated with {launcher.cluster_key_origin} (CURVE)", flush=True,
    )
    try:
        launcher.start_all(model)
        if not args.no_wait:
            launcher.wait_ready()
        if not launcher.stopping:
            for name, metrics_url in launcher.metrics_urls.items():
                print(f"pdserve: {name} metrics at {metrics_url}", flush=True)
            print(f"pdserve: fleet metrics (every instance) at {launcher.url}/metrics", flush=True)
            print(
                f"pdserve: ready at {launcher.url} (OpenAI base URL {launcher.url}/v1); Ctrl-C stops it",
                flush=True,
            )
        launcher.supervise()
    except ChildExited as exc:
        print(f"pdserve: {exc}; stopping everything", file=sys.stderr)
        tail = exc.child.log_tail()
        if tail:
            print(f"--- last output of {exc.child.name}:\n{tail}", file=sys.stderr)
        exit_code = exc.code if exc.code > 0 else 1
    except (TimeoutError, RuntimeError) as exc:
        print(f"pdserve: {exc}; stopping everything", file=sys.stderr)
        exit_code = 1
    finally:
        launcher.stop_all()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
