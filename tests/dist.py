"""Run a test function in N gloo processes from pytest, reusing the processes across tests.

``DistPool(n).run(fn, *args)`` sends ``fn`` (a module-level function, pickled by name) to
every rank, returns the per-rank results in rank order, and raises with the failing rank's
traceback. A rank that does not answer within the timeout kills the pool (a hung collective
cannot be recovered) and the error names the ranks that were silent.
"""
from __future__ import annotations

import os
import queue
import socket
import sys
import time
import traceback

import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    sys.path.insert(0, REPO)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megamoe.parallel.groups import release_groups

    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001  (report everything, including assertion errors)
            results.put((rank, False, traceback.format_exc()))
        # every test builds its own layouts: their gloo groups' threads (each waking every 10 ms)
        # would pile up in these long-lived workers and burn a core by the end of the suite.
        # All ranks release together, so the collective group teardown stays in step.
        release_groups()
    dist.destroy_process_group()
    # leave without the interpreter's teardown (seconds of freeing torch's and megatron-core's
    # modules, paid again by every pool at the end of the session): flush the answers, then go
    results.close()
    results.join_thread()
    os._exit(0)


class DistError(AssertionError):
    pass


class DistPool:
    def __init__(self, world_size: int, timeout: float = 300.0):
        self.world, self.timeout = world_size, timeout
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        if self.broken:
            raise DistError("the process pool was killed by an earlier failure")
        for q in self.tasks:
            q.put((fn, args, kwargs))
        got: dict[int, object] = {}
        failure = None
        while len(got) < self.world:
            try:
                # after one rank fails the others may be stuck in a collective: wait briefly
                wait = 20.0 if failure else (timeout or self.timeout)
                rank, ok, value = self.results.get(timeout=wait)
            except queue.Empty:
                self.kill()
                silent = sorted(set(range(self.world)) - set(got))
                if failure:
                    raise DistError(failure) from None
                raise DistError(f"{fn.__name__}: ranks {silent} did not answer within {wait:.0f}s") from None
            got[rank] = value
            if not ok and failure is None:
                failure = f"{fn.__name__} failed on rank {rank} of {self.world}:\n{value}"
        if failure:
            raise DistError(failure)
        return [got[r] for r in range(self.world)]

    def kill(self) -> None:
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def close(self, timeout: float = 10.0) -> None:
        self.stop()
        self.join(time.monotonic() + timeout)

    def stop(self) -> None:
        """Ask the workers to leave (``join`` waits for them): pools stop together, so closing
        several costs the slowest one's exit, not the sum."""
        if not self.broken:
            for q in self.tasks:
                q.put(None)

    def join(self, deadline: float) -> None:
        """Wait for the workers until ``deadline`` (``time.monotonic()``), then kill what is left."""
        if not self.broken:
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()


def side_by_side(commands: list[list[str]], envs: list[dict] | None = None, cwds: list | None = None,
                 timeout: float = 300, **popen) -> list:
    """Each command of ``commands`` (with its environment of ``envs`` and folder of ``cwds``) as a
    subprocess, all at once (independent runs whose time is mostly one core importing torch each);
    their ``subprocess.CompletedProcess``es, text output captured, in order. None is left running,
    also on a timeout."""
    import subprocess

    envs, cwds = envs or [None] * len(commands), cwds or [popen.pop("cwd", None)] * len(commands)
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, cwd=c, **popen)
             for cmd, e, c in zip(commands, envs, cwds)]
    try:
        streams = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, streams)]


def script_env(tmp_path, **knobs: str) -> dict:
    """The environment for running a pretrain_scripts/ script from a test: the knobs, one thread
    per process, and ``torchrun`` on PATH (a venv chained to another's site-packages has torch
    but not its console script: a shim runs ``python -m torch.distributed.run``)."""
    import shutil
    from pathlib import Path

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **knobs}
    if shutil.which("torchrun") is None and not (Path(REPO) / ".venv" / "bin" / "torchrun").exists():
        shim = Path(tmp_path) / "bin" / "torchrun"
        shim.parent.mkdir(exist_ok=True)
        shim.write_text('#!/bin/sh\nexec python -m torch.distributed.run "$@"\n')
        shim.chmod(0o755)
        env["PATH"] = f"{env.get('PATH', '')}:{shim.parent}"
    return env
