"""Tensor-parallel engines: one engine, its model split over ``--tensor-parallel-size`` processes.

Rank 0 is the engine's own process: it schedules, samples and talks to the rest of the system, and its
``ModelRunner`` runs its share of every forward. Ranks 1.. are worker processes it starts
(``python -m common.engine.tensor_parallel``), each a ``ModelRunner`` holding its share of the weights
and of the KV cache (its KV heads of every block: block ids mean the same blocks on every rank). The
model's partial sums meet over a torch.distributed group (gloo on the CPU, NCCL on GPUs).

Each step, rank 0 sends every worker the step's inputs over a private ZeroMQ socket (a typed msgpack
header and the index tensors as raw frames, as every socket of this project: no pickle), then broadcasts
the input ids over the group (on a GPU they may still be on their way from the last step's sampler:
async scheduling), and all ranks run the forward together; only rank 0 computes logits.

On the CPU the ranks' caches are one shared-memory tensor ``[ranks, layers, 2, blocks, ...]``, mapped by
every rank: rank 0's KV transfer moves every rank's heads of a block as it moves its own (the layout
on the wire counts ``ranks x layers`` layers of ``heads / ranks`` heads), so a tensor-parallel prefill
hands its blocks to a decode of the same size unchanged.

Failure: a worker that dies takes the engine with it, at once (``_Watchdog``: the process exits, and
whoever serves its requests continues them elsewhere, as after any engine's death); a worker whose
rank 0 died exits (the kernel's parent-death signal, and a watch on its parent).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq
from torch import Tensor

from common.model.parallel import TensorParallel

logger = logging.getLogger(__name__)

# How long a collective waits for the other ranks before it fails (a long prefill on a loaded CPU included).
COLLECTIVE_TIMEOUT_S = 600
# How long rank 0 waits for its workers to join the group at start (imports and a CUDA context each).
JOIN_TIMEOUT_S = 300
_CACHE_FILE = "kv-cache"
_WORKDIR_PREFIX = "pdserve-tp-"


def sweep_stale_workdirs(base: Path) -> None:
    """Remove the folders of rank-0 processes that are gone (``pdserve-tp-<pid>-...``): a process killed
    outright leaves its sockets' folder, and a cache file if it died before every rank mapped it."""
    for path in base.glob(f"{_WORKDIR_PREFIX}*-*"):
        pid = path.name.removeprefix(_WORKDIR_PREFIX).partition("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


class StepHeader(msgspec.Struct, tag="step", frozen=True):
    """One forward's shapes; its index tensors follow as raw frames in ``STEP_FRAMES`` order."""

    num_tokens: int
    num_seqs: int
    block_cols: int
    max_query_len: int
    copies: list[tuple[int, int]] = []  # copy-on-write block copies (source, destination) before it


class ZeroBlocks(msgspec.Struct, tag="zero", frozen=True):
    block_ids: list[int]


class HostCopies(msgspec.Struct, tag="host", frozen=True):
    """Copies between the KV cache and its host tier, in order (``common.kvcache.host_tier.HostCopy``)."""

    copies: list[tuple[int, int, int]]
    wait: bool = False  # every rank done before rank 0 goes on (a barrier after the copies)


class Stop(msgspec.Struct, tag="stop", frozen=True):
    pass


Control = StepHeader | ZeroBlocks | HostCopies | Stop
_DECODER = msgspec.msgpack.Decoder(Control)
_ENCODER = msgspec.msgpack.Encoder()
# The step's index tensors as the frames carry them: name, dtype, shape from the header.
STEP_FRAMES: tuple[tuple[str, torch.dtype], ...] = (
    ("positions", torch.long), ("slot_mapping", torch.long), ("context_lens", torch.int32),
    ("block_tables", torch.int32), ("query_start_loc", torch.int32),
)


def frame_shapes(header: StepHeader) -> dict[str, tuple[int, ...]]:
    n, s = header.num_tokens, header.num_seqs
    return {"positions": (n,), "slot_mapping": (n,), "context_lens": (s,), "block_tables": (s, header.block_cols),
            "query_start_loc": (s + 1,)}


def decode_step(header: StepHeader, frames: list[bytes | memoryview]) -> dict[str, Tensor]:
    """The step's host tensors from its frames, each checked against the header's shapes."""
    shapes = frame_shapes(header)
    if len(frames) != len(STEP_FRAMES):
        raise ValueError(f"a step carries {len(STEP_FRAMES)} frames, got {len(frames)}")
    tensors: dict[str, Tensor] = {}
    for (name, dtype), frame in zip(STEP_FRAMES, frames, strict=True):
        shape = shapes[name]
        expected = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if memoryview(frame).nbytes != expected:
            raise ValueError(f"step frame {name}: {memoryview(frame).nbytes} bytes, expected {expected}")
        tensors[name] = (torch.frombuffer(bytearray(frame), dtype=dtype) if expected else
                         torch.empty(0, dtype=dtype)).view(shape)
    return tensors


def device_of_rank(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU for all, or the ``rank``-th GPU from the engine's own."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def process_group(store: Any, rank: int, size: int, device: torch.device) -> Any:
    """The ranks' group over ``store``: NCCL between GPUs, gloo on the CPU (on the loopback interface)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def barrier(tp: TensorParallel, device: torch.device) -> None:
    """Wait until every rank got here (a sum of one element, on the group's device)."""
    tp.all_reduce(torch.zeros(1, device=device))


def shared_cache(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A tensor of ``shape`` over the file at ``path``, mapped shared (created zeroed where absent). Where the
    file is created, its folder must have room for it: a page written past a full tmpfs (a container's 64 MB
    /dev/shm, say) would end the process with SIGBUS, long after start."""
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    if not path.exists():
        free = shutil.disk_usage(path.parent).free
        if free < nbytes:
            raise ValueError(f"the tensor-parallel KV cache needs {nbytes / 2**20:.0f} MiB in {path.parent}, which has "
                             f"{free / 2**20:.0f} MiB free: lower --kv-cache-memory, or give it room (a container's "
                             "--shm-size)")
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8).view(dtype).view(shape)


class TPLeader:
    """Rank 0's side: starts the workers, joins their group, sends each step's inputs, stops them."""

    def __init__(self, config: Any, device: torch.device) -> None:
        import torch.distributed as dist

        size = config.tensor_parallel_size
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        sweep_stale_workdirs(base)
        # Its sockets, and its shared cache until every rank mapped it; named after this process, whose
        # successor removes it where this one could not (killed).
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-", dir=base))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks talk over the loopback interface only
        self.store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S),
                                   wait_for_workers=False)
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sockets: list[zmq.Socket[bytes]] = []
        self.workers: list[subprocess.Popen[bytes]] = []
        self.closing = False
        encoded = msgspec.json.encode(config)
        try:
            for rank in range(1, size):
                sock = self.context.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                address = f"ipc://{self.workdir}/rank-{rank}"
                sock.bind(address)
                self.sockets.append(sock)
                proc = subprocess.Popen(  # (its environment this one's: the loopback interface included)
                    [sys.executable, "-m", "common.engine.tensor_parallel", str(rank), str(size), str(self.store.port),
                     address, str(self.workdir)],
                    stdin=subprocess.PIPE, cwd=os.getcwd())
                assert proc.stdin is not None
                proc.stdin.write(encoded)  # the engine's config, as JSON (never a pickle)
                proc.stdin.close()
                self.workers.append(proc)
            self.group = process_group(self.store, 0, size, device)
        except BaseException:
            self.close()
            raise
        self.tp = TensorParallel(0, size, self.group)
        atexit.register(self.close)  # the group's threads must end before the interpreter does
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="tp-watchdog")
        self._watchdog.start()

    @property
    def cache_path(self) -> Path:
        return self.workdir / _CACHE_FILE

    @contextlib.contextmanager
    def in_step(self) -> Iterator[None]:
        """A step the ranks run in step: one that fails on this rank (a collective that lost a rank, or
        any error) leaves the others inside a collective it will never join, so it ends the engine."""
        try:
            yield
        except BaseException as e:
            self._fail(f"a tensor-parallel step failed on rank 0 ({type(e).__name__}: {e})")

    def _fail(self, why: str) -> None:
        logger.critical("%s: this engine stops", why)
        self.closing = True
        self._kill_workers()
        shutil.rmtree(self.workdir, ignore_errors=True)
        os._exit(70)

    def _watch(self) -> None:
        """A worker gone is this engine gone: its shard of every layer is lost, and every rank's next
        collective would wait for it until it timed out. The process exits; the requests it served
        continue elsewhere (the router notices the instance is gone, as after any engine's death)."""
        while not self.closing:
            for rank, proc in enumerate(self.workers, start=1):
                code = proc.poll()
                if code is not None and not self.closing:
                    self._fail(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")
            time.sleep(0.2)

    def send(self, msg: Control, frames: Sequence[Any] = ()) -> None:
        """``msg`` (and its raw frames) to every worker."""
        head = _ENCODER.encode(msg)
        for sock in self.sockets:
            if frames:
                sock.send_multipart([head, *frames])  # copied: the input buffers are rewritten next step
            else:
                sock.send(head)

    def step(self, header: StepHeader, tensors: list[Tensor], input_ids: Tensor) -> None:
        """Send the workers a step (its index tensors, in ``STEP_FRAMES`` order), then its input ids."""
        self.send(header, [t.contiguous().numpy() for t in tensors])
        self.tp.broadcast(input_ids)

    def _kill_workers(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()

    def close(self) -> None:
        """Stop the workers (asked, then killed after a few seconds) and free what the group held."""
        if self.closing:
            return
        self.closing = True
        with contextlib.suppress(zmq.ZMQError):
            for sock in self.sockets:
                sock.send(_ENCODER.encode(Stop()), zmq.NOBLOCK)
        deadline = time.monotonic() + 10
        for proc in self.workers:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in self.sockets:
            sock.close()
        group = getattr(self, "group", None)
        if group is not None:
            with contextlib.suppress(Exception):
                group.shutdown()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _die_with_parent() -> None:
    """Linux: this process is killed when the one that started it ends (however it ends)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = os.getppid()

    def watch() -> None:  # where the signal is not to be had, or the parent died before it was set
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def worker_main(argv: list[str]) -> None:
    """A worker rank: build its share of the model and cache in step with rank 0, then run each step it
    is sent until told to stop."""
    import torch.distributed as dist

    from common.config import EngineConfig
    from common.engine.model_runner import ModelRunner
    from common.kvcache.host_tier import HostCopy

    _die_with_parent()
    rank, size, port, address, workdir = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], Path(argv[4])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(name)s: %(message)s")
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
    sock.connect(address)
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    device = device_of_rank(config.torch_device, rank)
    group = process_group(store, rank, size, device)
    tp = TensorParallel(rank, size, group)
    runner = ModelRunner(config, tp=tp, cache_path=workdir / _CACHE_FILE)
    while True:
        parts = sock.recv_multipart(copy=False)
        msg = _DECODER.decode(parts[0].buffer)
        if isinstance(msg, Stop):
            break
        if isinstance(msg, ZeroBlocks):
            runner.zero_blocks(msg.block_ids)
            continue
        if isinstance(msg, HostCopies):
            runner.copy_host([HostCopy(*c) for c in msg.copies], wait=msg.wait)
            continue
        runner.execute_worker_step(msg, decode_step(msg, [p.buffer for p in parts[1:]]))
    with contextlib.suppress(Exception):
        group.shutdown()
    os._exit(0)


if __name__ == "__main__":
    worker_main(sys.argv[1:])
