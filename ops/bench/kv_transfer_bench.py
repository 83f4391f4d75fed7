"""KV transfer throughput between two processes, beside a plain TCP socket and a memcpy.

Moves the KV of one prompt (default: 2,000 tokens of SmolLM2-135M, 30 layers, 3 KV heads, head
size 64, float32, block size 16: about 92 MB) from a ``KVSender`` in this process to a
``KVReceiver`` in a child process, repeatedly, over tcp:// and ipc://, in three block-id
patterns, on both sides: consecutive ids (what a prompt gets from a pool that is not fragmented,
e.g. a fresh one: KVTransfer then sends the cache's memory as it is and receives with plain
copies), recycled ids (what the engine's block pool hands out after a few hundred requests came
and went: runs of consecutive ids of varied length; ``--contiguity-window 1`` makes that pool
strict LRU, as it was before it preferred runs) and shuffled ids (the worst case: every block
gathered and scattered on its own). A timed transfer runs from ``send()`` until the sender's
result (the receiver's acknowledgement that every block landed).

The baselines move the same number of bytes: a plain TCP socket (``sendall`` / ``recv_into``
into a preallocated buffer, then a 1-byte acknowledgement), ZMQ alone (the same frames already
packed, received and not scattered: the transport without the pack/unpack copies) and an
in-process copy between two preallocated tensors. The paths take turns transfer by transfer, so
a busy neighbour on the host slows all of them alike. A second, shorter pass runs each path on
its own to measure the CPU time each process spends per transfer.

The receiving process starts with the C-library settings ``pdserve up`` gives the engines
(``common.glibc_env``); ``--glibc-defaults`` starts it without them, to measure what they do.

Run: ``python -m ops.bench.kv_transfer_bench [--iters 20] [--block-ids consecutive,recycled,scattered]
[--glibc-defaults] [--contiguity-window N] [--json] [--out PATH]``; ``--out`` writes the figures as
JSON (with the date, the host and the command) and a bar chart beside it (``.png``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import multiprocessing as mp
import os
import platform
import random
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import zmq

from common.engine.request import Request
from common.glibc_env import tuned_env
from common.kvcache.block_pool import BlockPool
from common.kvcache.kv_cache_manager import KVCacheManager
from common.sampling_params import SamplingParams
from kvtransfer import Allocation, KVLayout, KVReceiver, KVSender
from kvtransfer.sending.sender import DEFAULT_LAYERS_PER_FRAME
from kvtransfer.wire.frames import BlockRuns, auto_layers_per_frame
from ops.bench.environ import child_env

_POLL_S = 0.001  # the engine-loop poll interval on both sides (a real engine step is longer)
RESULTS_DIR = Path(__file__).parent / "results"


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _kv_cache(args: argparse.Namespace, num_blocks: int, seed: int) -> torch.Tensor:
    shape = (args.num_layers, 2, num_blocks, args.block_size, args.num_kv_heads, args.head_size)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(getattr(torch, args.dtype))


PATTERNS = ("consecutive", "recycled", "scattered")
POOL_SIZE = 4  # blocks in each pool per block of the transfer


def _recycled_ids(
    pool_blocks: int, num_blocks: int, block_size: int, seed: int, contiguity_window: int | None = None
) -> list[int]:
    """The ids the engine's block pool gives a request of ``num_blocks`` after some traffic.

    Requests of 1 to ``num_blocks // 2`` blocks (random tokens, so full blocks are prefix-cached
    when freed) come and go through a ``KVCacheManager`` of ``pool_blocks`` blocks, about half of
    it in use, for a few hundred arrivals; then one request takes ``num_blocks`` blocks.
    ``contiguity_window`` overrides the pool's (``BlockPool.contiguity_window``; 1: strict LRU).
    """
    rng = random.Random(seed)
    kv = KVCacheManager(pool_blocks, block_size)
    if contiguity_window is not None:
        kv.pool.contiguity_window = contiguity_window
    live: list[Request] = []

    def admit(request_id: str, blocks: int) -> bool:
        tokens = [rng.randrange(1 << 15) for _ in range(blocks * block_size)]
        req = Request(request_id, tokens, SamplingParams(), block_size=block_size, model_id="bench")
        if not kv.allocate_slots(req, req.num_tokens):
            return False
        req.num_computed_tokens = req.num_tokens
        kv.cache_blocks(req)
        live.append(req)
        return True

    for i in range(400):
        while live and (kv.pool.num_free_blocks < pool_blocks // 2 or rng.random() < 0.4):
            kv.free(live.pop(rng.randrange(len(live))).request_id)
        admit(f"r{i}", rng.randint(1, max(1, num_blocks // 2)))
    while kv.pool.num_free_blocks < num_blocks:
        kv.free(live.pop(rng.randrange(len(live))).request_id)
    if not admit("last", num_blocks):
        raise RuntimeError("the churned pool could not fit the transfer")
    return kv.block_ids("last")


class _Pool:
    """Hands out the same block ids for every transfer: ``consecutive`` (one run of ids, as from a
    pool that is not fragmented), ``recycled`` (as the engine's pool does after traffic, see
    ``_recycled_ids``) or ``scattered`` (a random permutation: the worst case)."""

    def __init__(self, ids: list[int], block_size: int) -> None:
        self.ids = ids
        self.block_size = block_size

    def allocate_for_transfer(
        self, request_id: str, block_hashes: list[bytes], num_tokens: int, meta: bytes = b""
    ) -> Allocation | str:
        # Never "full": a receiver's transfers run one after another, so they never write the
        # same blocks at once, and an offer need not wait for the engine loop to release the last.
        return Allocation(self.ids[: -(-num_tokens // self.block_size)], 0)

    def release_transfer(self, request_id: str) -> None:
        pass


def _block_ids(
    pattern: str,
    num_pool_blocks: int,
    num_blocks: int,
    block_size: int,
    seed: int,
    contiguity_window: int | None = None,
) -> list[int]:
    if pattern == "consecutive":
        first = seed % (num_pool_blocks - num_blocks + 1)
        return list(range(first, first + num_blocks))
    if pattern == "recycled":
        return _recycled_ids(num_pool_blocks, num_blocks, block_size, seed, contiguity_window)
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_pool_blocks, generator=gen)[:num_blocks].tolist()


def _block_sums(kv_cache: torch.Tensor, block_ids: list[int]) -> list[float]:
    """One sum per block, in ``block_ids`` order: a block landing in the wrong place shows."""
    return kv_cache[:, :, block_ids].double().sum(dim=(0, 1, 3, 4, 5)).tolist()


# ---- the receiving process ------------------------------------------------------------------
def _serve(conn: Connection, args_json: str) -> None:
    """Child process: KV receivers (per transport and id pattern), a ZMQ and a plain TCP receiver."""
    args = argparse.Namespace(**json.loads(args_json))
    nbytes = args.nbytes
    num_blocks = -(-args.num_tokens // args.block_size)
    caches: dict[str, torch.Tensor] = {}
    pools: dict[str, _Pool] = {}
    receivers: dict[str, KVReceiver] = {}
    for pattern in args.block_id_patterns:
        ids = _block_ids(
            pattern, POOL_SIZE * num_blocks, num_blocks, args.block_size, 2, args.contiguity_window
        )
        for transport in args.transport_list:  # a cache each: what one receiver wrote stays checkable
            name = f"{transport}/{pattern}"
            kv_cache = caches[name] = _kv_cache(args, POOL_SIZE * num_blocks, seed=1)
            layout = KVLayout.from_kv_cache(kv_cache, args.model_id)
            pools[name] = _Pool(ids, args.block_size)
            address = (
                "tcp://127.0.0.1:0"
                if transport == "tcp"
                else f"ipc://{tempfile.gettempdir()}/kv-bench-{os.getpid()}-{pattern}.sock"
            )
            receivers[name] = KVReceiver(address, kv_cache, layout, pools[name], timeout_s=30.0)
    last_block_ids: dict[str, list[int]] = {}
    stop = threading.Event()

    def engine_loop() -> None:  # what a decode engine's step loop does with the receivers
        while not stop.is_set():
            for name, receiver in receivers.items():
                for result in receiver.poll():
                    if result.ok:
                        last_block_ids[name] = result.block_ids
                        pools[name].release_transfer(result.request_id)  # the "engine" is done
            time.sleep(_POLL_S)

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.linger = 0
    router.bind("tcp://127.0.0.1:0")
    listener = socket.create_server(("127.0.0.1", 0))
    threads = [
        threading.Thread(target=engine_loop, daemon=True),
        threading.Thread(target=_serve_zmq, args=(router, nbytes), daemon=True),
        threading.Thread(target=_serve_plain, args=(listener, nbytes), daemon=True),
    ]
    for thread in threads:
        thread.start()
    addresses = {name: r.address for name, r in receivers.items()}
    addresses["zmq"] = router.getsockopt_string(zmq.LAST_ENDPOINT)
    addresses["plain"] = str(listener.getsockname()[1])
    addresses["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")  # what this process started with
    conn.send_bytes(json.dumps(addresses).encode())
    while True:
        op = conn.recv_bytes().decode()
        if op == "cpu":
            conn.send_bytes(json.dumps(_cpu_s()).encode())
        elif op == "checksums":  # blocks keep their data after release; nothing overwrites them here
            sums = {n: _block_sums(caches[n], ids) for n, ids in last_block_ids.items()}
            conn.send_bytes(json.dumps(sums).encode())
        else:
            stop.set()
            for receiver in receivers.values():
                receiver.close()
            return


def _serve_zmq(sock: zmq.Socket, nbytes: int) -> None:
    """ZMQ alone: receive frames until ``nbytes`` arrived, acknowledge, repeat."""
    got = 0
    while True:
        identity, _header, *data = sock.recv_multipart(copy=False)
        got += sum(len(frame) for frame in data)
        if got >= nbytes:
            sock.send_multipart([identity, b"k"])
            got = 0


def _serve_plain(listener: socket.socket, nbytes: int) -> None:
    peer, _ = listener.accept()
    view = memoryview(bytearray(nbytes))
    while True:
        got = 0
        while got < nbytes:
            n = peer.recv_into(view[got:], nbytes - got)
            if n == 0:
                return
            got += n
        peer.sendall(b"k")


# ---- the sending process --------------------------------------------------------------------
class _Paths:
    """One ``run()`` per path: moves the bytes once and returns when the receiver has them."""

    def __init__(self, args: argparse.Namespace, addresses: dict[str, str]) -> None:
        num_blocks = -(-args.num_tokens // args.block_size)
        pool_blocks = POOL_SIZE * num_blocks
        self.kv_cache = _kv_cache(args, pool_blocks, seed=3)
        layout = KVLayout.from_kv_cache(self.kv_cache, args.model_id)
        self.block_ids = {
            p: _block_ids(p, pool_blocks, num_blocks, args.block_size, 5, args.contiguity_window)
            for p in args.block_id_patterns
        }
        self.num_runs = {p: len(BlockRuns(ids).runs()) for p, ids in self.block_ids.items()}
        self.num_tokens = args.num_tokens
        self.nbytes = num_blocks * layout.bytes_per_block
        self.sender = KVSender(self.kv_cache, layout, timeout_s=30.0, layers_per_frame=args.layers_per_frame)
        self.addresses = addresses
        self.count = 0
        layers = args.layers_per_frame or auto_layers_per_frame(num_blocks, layout.bytes_per_block_layer)
        num_frames = -(-args.num_layers // layers)
        self.frame_bounds = [self.nbytes * i // num_frames for i in range(num_frames + 1)]
        self.data = torch.randint(0, 255, (self.nbytes,), dtype=torch.uint8)
        self.context = zmq.Context()
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.linger = 0
        self.dealer.connect(addresses["zmq"])
        self.plain = socket.create_connection(("127.0.0.1", int(addresses["plain"])))
        self.copy_dst = torch.empty_like(self.data)

    def runners(self, transports: list[str], patterns: list[str]) -> dict[str, Callable[[], None]]:
        paths: dict[str, Callable[[], None]] = {}
        for pattern in patterns:
            for transport in transports:
                paths[_kv_path(transport, pattern)] = functools.partial(self.kv, transport, pattern)
        paths["zmq tcp:// wire only"] = self.zmq_wire
        paths["plain TCP socket"] = self.plain_tcp
        paths["memcpy (one process)"] = self.memcpy
        return paths

    def memcpy(self) -> None:
        self.copy_dst.copy_(self.data)

    def kv(self, transport: str, pattern: str) -> None:
        self.count += 1
        self.sender.send(
            f"bench-{self.count}",
            self.addresses[f"{transport}/{pattern}"],
            self.block_ids[pattern],
            [],
            self.num_tokens,
        )
        while True:
            results = self.sender.poll()
            if results:
                if not results[0].ok or results[0].bytes_sent != self.nbytes:
                    raise RuntimeError(f"transfer failed: {results[0].reason}")
                return
            time.sleep(_POLL_S)

    def zmq_wire(self) -> None:
        data = memoryview(self.data.numpy().data)
        for lo, hi in zip(self.frame_bounds, self.frame_bounds[1:], strict=False):
            self.dealer.send_multipart([b"d", data[lo:hi]], copy=False)
        self.dealer.recv()

    def plain_tcp(self) -> None:
        self.plain.sendall(self.data.numpy().data)
        if self.plain.recv(1) != b"k":
            raise RuntimeError("plain receiver went away")

    def close(self) -> None:
        self.sender.close()
        self.dealer.close()
        self.context.term()
        self.plain.close()


def _kv_path(transport: str, pattern: str) -> str:
    short = {"consecutive": "consec.", "recycled": "recycled", "scattered": "scatter"}[pattern]
    return f"kvtransfer {transport}:// {short}"


def _time_interleaved(
    paths: dict[str, Callable[[], None]], iters: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds per transfer, the paths taking turns (in a rotating order)."""
    names = list(paths)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + iters):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            paths[name]()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def _cpu_per_transfer(conn: Connection, paths: dict[str, Callable[[], None]], iters: int) -> dict[str, dict]:
    """CPU milliseconds per transfer in this process and in the receiving one, path by path."""
    out = {}
    for name, run in paths.items():
        conn.send_bytes(b"cpu")
        child0, parent0 = json.loads(conn.recv_bytes()), _cpu_s()
        for _ in range(iters):
            run()
        parent1 = _cpu_s()
        conn.send_bytes(b"cpu")
        child1 = json.loads(conn.recv_bytes())
        if not name.startswith("memcpy"):
            out[name] = {
                "sender_cpu_ms": (parent1 - parent0) * 1e3 / iters,
                "receiver_cpu_ms": (child1 - child0) * 1e3 / iters,
            }
    return out


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--num-tokens", type=int, default=2000)
    p.add_argument("--num-layers", type=int, default=30)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--model-id", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--iters", type=int, default=20, help="timed transfers per path")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cpu-iters", type=int, default=5, help="transfers per path in the CPU pass (0: skip)")
    p.add_argument("--layers-per-frame", type=int, default=DEFAULT_LAYERS_PER_FRAME, help="0: automatic")
    p.add_argument("--transports", default="tcp,ipc", help="comma-separated: tcp, ipc")
    p.add_argument(
        "--block-ids",
        default=",".join(PATTERNS),
        help="comma-separated: consecutive (both pools hand out a run of ids), recycled (ids as the "
        "engine's pool hands them out after traffic), scattered (shuffled ids)",
    )
    p.add_argument(
        "--glibc-defaults",
        action="store_true",
        help="start the receiving process without the engines' C-library settings (common.glibc_env)",
    )
    p.add_argument(
        "--contiguity-window",
        type=int,
        default=None,
        help="the block pool's contiguity window for recycled ids (default: the pool's; 1: strict LRU)",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    p.add_argument(
        "--out",
        default=None,
        metavar="PATH",
        help=f"also write the figures as JSON to PATH and a bar chart beside it (e.g. {RESULTS_DIR.name}/"
        "kv-transfer-cpu-<date>.json)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """``pdserve bench kv``: 0 when every path delivered the bytes it sent, else 1."""
    report = run(argv)
    return 0 if all(report["checksum_ok"].values()) else 1


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table (or JSON) and return the figures."""
    args = _parse(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    transports = args.transport_list = args.transports.split(",")
    if not set(transports) <= {"tcp", "ipc"}:
        raise SystemExit(f"unknown transport in {args.transports!r}")
    patterns = args.block_id_patterns = args.block_ids.split(",")
    if not set(patterns) <= set(PATTERNS):
        raise SystemExit(f"unknown block-id pattern in {args.block_ids!r}")
    num_blocks = -(-args.num_tokens // args.block_size)
    element_size = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    args.nbytes = (
        num_blocks * args.num_layers * 2 * args.block_size * args.num_kv_heads * args.head_size * element_size
    )
    load_before = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, json.dumps(vars(args))), daemon=True)
    args.receiver_env = {"GLIBC_TUNABLES": ""} if args.glibc_defaults else tuned_env(os.environ)
    with child_env(args.receiver_env):  # read by the C library when the child starts
        proc.start()
    paths = None
    try:
        addresses = json.loads(parent.recv_bytes())
        args.receiver_tunables = addresses.pop("glibc_tunables")
        paths = _Paths(args, addresses)
        runners = paths.runners(transports, patterns)
        times = _time_interleaved(runners, args.iters, args.warmup)
        cpu = _cpu_per_transfer(parent, runners, args.cpu_iters) if args.cpu_iters else {}
        parent.send_bytes(b"checksums")
        sums = json.loads(parent.recv_bytes())
        args.num_runs = paths.num_runs
        checks = {}
        for pattern in patterns:
            expected = torch.tensor(_block_sums(paths.kv_cache, paths.block_ids[pattern]), dtype=torch.float64)
            for t in transports:
                got = torch.tensor(sums.get(f"{t}/{pattern}", []), dtype=torch.float64)
                checks[f"{t}/{pattern}"] = got.shape == expected.shape and torch.allclose(got, expected)
    finally:  # on any error too: the sender's thread and the child must not outlive this call
        if paths is not None:
            paths.close()
        with contextlib.suppress(OSError):
            parent.send_bytes(b"exit")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return _report(args, times, cpu, checks, load_before)


def _report(
    args: argparse.Namespace, times: dict, cpu: dict, checks: dict, load_before: float
) -> dict[str, Any]:
    rows = {}
    for name, samples in times.items():
        rows[name] = {
            "gbps_median": args.nbytes / statistics.median(samples) / 1e9,
            "gbps_best": args.nbytes / min(samples) / 1e9,
            "ms_median": statistics.median(samples) * 1e3,
            **cpu.get(name, {}),
        }
    plain = rows["plain TCP socket"]["gbps_median"]
    ratios = {name: row["gbps_median"] / plain for name, row in rows.items()}
    report = {
        "bytes": args.nbytes,
        "samples_per_path": args.iters,
        "layers_per_frame": args.layers_per_frame,
        "receiver_glibc_tunables": args.receiver_tunables or "defaults",
        "contiguity_window": args.contiguity_window or BlockPool(1).contiguity_window,
        "sender_runs_of_ids": args.num_runs,
        "rows": rows,
        "ratio_to_plain_tcp": ratios,
        "checksum_ok": checks,
        "load_average_1m": [load_before, os.getloadavg()[0]],
    }
    if args.out:
        _save(report, Path(args.out), args.argv)
    if args.json:
        print(json.dumps(report, indent=2))
        return report
    print(
        f"{args.nbytes / 1e6:.1f} MB per transfer, {args.iters} transfers per path (taking turns); "
        f"layers_per_frame={args.layers_per_frame or 'auto'}; host load {load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print("receiving process GLIBC_TUNABLES:", args.receiver_tunables or "none (glibc defaults)")
    print(f"{'path':<30}{'GB/s':>8}{'best':>8}{'ms':>9}{'vs plain':>10}{'cpu ms tx/rx':>16}")
    for name, row in rows.items():
        cpu_ms = f"{row['sender_cpu_ms']:.0f}/{row['receiver_cpu_ms']:.0f}" if "sender_cpu_ms" in row else "-"
        print(
            f"{name:<30}{row['gbps_median']:>8.2f}{row['gbps_best']:>8.2f}"
            f"{row['ms_median']:>9.1f}{ratios[name]:>9.0%}{cpu_ms:>16}"
        )
    print("GB/s: median transfer; 'vs plain': that median over the plain socket's median")
    print("runs of consecutive ids on the sending side:", args.num_runs)
    print("received data checksum matches:", checks)
    return report


def _save(report: dict[str, Any], path: Path, argv: list[str]) -> None:
    """Write ``report`` with when, where and how it was made, and a bar chart beside it if possible."""
    saved = {
        "date": datetime.date.today().isoformat(),
        "device": f"cpu ({os.cpu_count()} cores, sender and receiver processes on the same host)",
        "platform": platform.platform(),
        "command": " ".join(
            [*(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS",) if k in os.environ)]
            + ["python -m ops.bench.kv_transfer_bench", *argv]
        ),
        **report,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    if _plot(report, path.with_suffix(".png")):
        saved["plot"] = path.with_suffix(".png").name
    path.write_text(json.dumps(saved, indent=2) + "\n")


def _plot(report: dict[str, Any], path: Path) -> bool:
    """Median GB/s per path (best as a tick), the plain socket's median as a line; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n in report["rows"] if not n.startswith("memcpy")]
    medians = [report["rows"][n]["gbps_median"] for n in names]
    best = [report["rows"][n]["gbps_best"] for n in names]
    fig, ax = plt.subplots(figsize=(9, 4))
    colors = ["tab:blue" if n.startswith("kvtransfer") else "tab:gray" for n in names]
    bars = ax.barh(names, medians, color=colors)
    ax.plot(best, names, "k|", markersize=12, label="best transfer")
    ax.axvline(report["rows"]["plain TCP socket"]["gbps_median"], color="tab:red", ls="--", label="plain TCP")
    for bar, name in zip(bars, names, strict=True):
        ratio = report["ratio_to_plain_tcp"][name]
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {ratio:.0%}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(
        xlabel="GB/s (median of the transfers; label: vs the plain TCP socket's median)",
        title=f"KV transfer, {report['bytes'] / 1e6:.0f} MB per transfer, {report['samples_per_path']} per path",
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
