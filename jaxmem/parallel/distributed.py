"""Multi-process start-up: `jax.distributed.initialize` from a launch's flags or the cluster.

    --coordinator HOST:PORT --num-processes N --process-id I    explicit (jaxmem.launch sets them)
    (none of them, under Slurm / Open MPI / Kubernetes)          JAX's own cluster detection
    (none of them, elsewhere)                                    one process, no initialize

These flags describe one launch, not the run (each process has its own --process-id), so they
are not RunConfig fields and are not stored in config.json.

Heartbeat: JAX's default heartbeat timeout is 100 s, so a dead peer leaves the others waiting
that long. `--heartbeat-timeout` (default 20 s) makes a survivor stop sooner. Measured here (CPU,
jax 0.10.2): the survivor is aborted by JAX's coordination service (SIGABRT) whose log names the
lost task; `jaxmem.launch` then also names the peer that died first (docs/distributed.md).
It must run before anything touches the JAX backend (jax.devices(), any array).
"""

from __future__ import annotations

import argparse
import os

import jax

from jaxmem.errors import ConfigError

HEARTBEAT_DEFAULT = 20
# Environment variables through which JAX's cluster detection finds a multi-process job.
CLUSTER_ENV = {"SLURM_NTASKS": "Slurm", "OMPI_COMM_WORLD_SIZE": "Open MPI",
               "JOB_COMPLETION_INDEX": "Kubernetes (indexed job)"}


def add_process_flags(group) -> None:
    """Add --coordinator, --num-processes, --process-id, --heartbeat-timeout to an argparse group."""
    group.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                       help="address of process 0's coordination service (multi-host runs); "
                            "omitted: JAX detects Slurm / Open MPI / Kubernetes, else one process")
    group.add_argument("--num-processes", type=_positive, metavar="N", default=None,
                       help="processes in the run (with --coordinator)")
    group.add_argument("--process-id", type=_nonneg, metavar="I", default=None,
                       help="this process's index, 0 .. N-1 (with --coordinator)")
    group.add_argument("--heartbeat-timeout", type=_positive, metavar="SECONDS",
                       default=HEARTBEAT_DEFAULT,
                       help=f"seconds without a peer's heartbeat before the run stops "
                            f"(default: {HEARTBEAT_DEFAULT}; JAX's own default is 100)")


def _int(text, ok, what):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _positive(text):
    return _int(text, lambda v: v > 0, "a positive integer")


def _nonneg(text):
    return _int(text, lambda v: v >= 0, "an integer >= 0")


def check_process_flags(coordinator, num_processes, process_id) -> None:
    """ConfigError naming the flag when the combination cannot start a run."""
    if (num_processes is not None or process_id is not None) and coordinator is None:
        given = "--num-processes" if num_processes is not None else "--process-id"
        raise ConfigError(f"{given} needs --coordinator HOST:PORT (the address of process 0)")
    if coordinator is not None:
        host, sep, port = coordinator.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"--coordinator {coordinator!r}: expected HOST:PORT")
        if num_processes is None or process_id is None:
            raise ConfigError("--coordinator needs --num-processes and --process-id")
        if process_id >= num_processes:
            raise ConfigError(f"--process-id {process_id} must be below --num-processes "
                              f"{num_processes}")


def cluster_name() -> str | None:
    """The multi-process cluster JAX would detect from the environment, or None."""
    for var, name in CLUSTER_ENV.items():
        value = os.environ.get(var)
        if value and (var == "JOB_COMPLETION_INDEX" or value.isdigit() and int(value) > 1):
            return name
    return None


def initialize(coordinator=None, num_processes=None, process_id=None,
               heartbeat_timeout: int = HEARTBEAT_DEFAULT) -> bool:
    """Start JAX's multi-controller runtime when this is a multi-process run; True if started.

    Call before anything initializes the backend. ConfigError for a bad flag combination."""
    check_process_flags(coordinator, num_processes, process_id)
    timeouts = dict(heartbeat_timeout_seconds=heartbeat_timeout, initialization_timeout=120)
    if coordinator is not None:
        if num_processes == 1:
            return False
        jax.distributed.initialize(coordinator, num_processes, process_id, **timeouts)
        return True
    if cluster_name() is not None:
        jax.distributed.initialize(**timeouts)
        return True
    return False


def initialize_from_args(args) -> bool:
    """`initialize` with the flags of `add_process_flags`."""
    return initialize(args.coordinator, args.num_processes, args.process_id,
                      args.heartbeat_timeout)
