"""`python -m jaxmem.launch`: a multi-process run on one machine, for trying multi-host on CPU
(docs/distributed.md).

    python -m jaxmem.launch --processes 2 --devices-per-process 4 -- --steps 50 --out runs/mp

starts `python -m jaxmem.train <flags> --coordinator localhost:PORT --num-processes 2
--process-id I` for I = 0, 1, each with its own CPU devices (JAX_NUM_CPU_DEVICES) and
JAX_PLATFORMS=cpu; on the CPU backend jax 0.10.2 runs the collectives through gloo. PORT is a
free port (bind to port 0). Real clusters do not need this: run the train command once per host
with --coordinator / --num-processes / --process-id, or let JAX detect Slurm, Open MPI or
Kubernetes (docs/distributed.md).

The launcher watches its children. When one ends with an error or a signal while the others
still run, it names it ("process 1 (pid N) was killed by SIGKILL") and gives the others
--grace seconds to stop on their own (JAX's heartbeat timeout ends them with an error naming the
lost task) before it terminates them. Exit status: 0 when every process exited 0, else the
first failure's status (128 + signal for a signal). SIGINT / SIGTERM are passed on to all.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A TCP port nobody listens on now (bind to port 0; the OS picks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxmem.launch",
        description="Run jaxmem.train as N local processes with CPU devices each (multi-host on "
                    "one machine). Train flags go after '--'.")
    p.add_argument("--processes", type=int, default=2, metavar="N", help="processes (default 2)")
    p.add_argument("--devices-per-process", type=int, default=1, metavar="D",
                   help="simulated CPU devices per process (default 1)")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--grace", type=float, default=45.0, metavar="SECONDS",
                   help="after a process fails, seconds the others get to stop on their own "
                        "before they are terminated (default 45)")
    p.add_argument("--module", default="jaxmem.train", help=argparse.SUPPRESS)
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then jaxmem.train's flags")
    return p


def _describe(i: int, proc: subprocess.Popen) -> str:
    rc = proc.returncode
    how = (f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}")
    return f"process {i} (pid {proc.pid}) {how}"


def _status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    procs = _start(args, _train_flags(parser, args))
    return _report(procs, _watch(procs, args.grace))


def _train_flags(parser, args) -> list[str]:
    """The train flags after '--', checked: the launcher sets the multi-process flags itself."""
    rest = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.processes < 1:
        parser.error(f"--processes must be >= 1, got {args.processes}")
    if args.devices_per_process < 1:
        parser.error(f"--devices-per-process must be >= 1, got {args.devices_per_process}")
    for flag in ("--coordinator", "--num-processes", "--process-id"):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            parser.error(f"{flag} is set by the launcher; leave it out of the train flags")
    return rest


def _start(args, rest: list[str]) -> list[subprocess.Popen]:
    """One `python -m jaxmem.train` per process, on CPU devices, all to one coordinator."""
    port = args.port or free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(args.devices_per_process))
    procs = []
    for i in range(args.processes):
        cmd = [sys.executable, "-m", args.module, *rest, "--coordinator", f"localhost:{port}",
               "--num-processes", str(args.processes), "--process-id", str(i)]
        procs.append(subprocess.Popen(cmd, env=env))
    return procs


def _watch(procs: list[subprocess.Popen], grace: float):
    """Wait until every process has ended, passing SIGINT / SIGTERM on to them. The first to
    fail while others run is named, and the others get `grace` seconds to stop on their own.
    Returns (index, process) of that first failure, or None."""
    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    first_failure, deadline = None, None
    try:
        while any(p.poll() is None for p in procs):
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0) and first_failure is None:
                    first_failure = (i, p)
                    print(f"jaxmem.launch: {_describe(i, p)}; the other processes lose their peer "
                          f"and get {grace:g} s to stop", file=sys.stderr, flush=True)
                    deadline = time.monotonic() + grace
            if deadline is not None and time.monotonic() > deadline:
                deadline = _stop_the_others(procs, first_failure[0])
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return first_failure


def _stop_the_others(procs: list[subprocess.Popen], failed: int) -> float:
    """Terminate the processes still running (their peer `failed` is gone), kill those that
    do not end within 10 s; returns the next deadline."""
    for i, p in enumerate(procs):
        if p.poll() is None:
            print(f"jaxmem.launch: terminating process {i} (pid {p.pid}): its peer "
                  f"process {failed} is gone", file=sys.stderr, flush=True)
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    return deadline


def _report(procs: list[subprocess.Popen], first_failure) -> int:
    """The exit status: 0 when every process exited 0, else the first failure's (named, with
    the others that failed after it)."""
    if first_failure is None:
        failed = [(i, p) for i, p in enumerate(procs) if p.returncode != 0]
        first_failure = failed[0] if failed else None
    if first_failure is None:
        return 0
    others = [_describe(i, p) for i, p in enumerate(procs) if p is not first_failure[1]
              and p.returncode != 0]
    print(f"jaxmem.launch: failed: {_describe(*first_failure)}"
          + (f"; then {'; '.join(others)}" if others else ""), file=sys.stderr, flush=True)
    return _status(first_failure[1].returncode)


if __name__ == "__main__":
    sys.exit(main())
