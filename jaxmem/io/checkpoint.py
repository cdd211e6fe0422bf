"""Orbax checkpoints of the whole train state plus a JSON metadata dict.

One step directory holds two items, written by one `ocp.CheckpointManager`:

    <directory>/<step>/state   the train-state pytree (StandardSave: params, optimizer state,
                               loss scale, step, RNG key data, data position ...)
    <directory>/<step>/meta    a JSON dict (JsonSave: config, data stats, git hash ...)

Atomicity (checked in orbax-checkpoint 0.12.8, `_src/path/atomicity.py` and
`_src/path/atomicity_defaults.py`): on a local filesystem the manager uses
`AtomicRenameTemporaryPath`: a step is written into `<step>.orbax-checkpoint-tmp...`, a
`commit_success.txt` is written last, and only then is the directory renamed to `<step>`.
Listing (`StepNameFormat.find_all`) ignores the tmp directories, so `latest_step()` and
`restore()` only ever see steps Orbax committed; a process killed mid-save leaves an ignored tmp
directory that `cleanup_tmp_directories=True` removes the next time a manager is opened. (On GCS
Orbax uses `CommitFileTemporaryPath` instead: no rename, the step counts once
`commit_success.txt` exists.) Nothing here unpickles anything: Orbax stores arrays with
TensorStore and metadata as JSON.

Asynchronous saves (`save(..., wait=False)`, what the train loop does): Orbax's
`CheckpointManager` (async checkpointing on, the default of orbax 0.12.8) returns from `save`
once every array is copied to host memory (its "blocking" part: `replica_slices.
transfer_arrays_to_host`, `np.asarray` of each shard), then writes the files and commits in a
background thread; the device buffers may be donated to the next train step right away.
`last_pause_s` is the time `save` held the caller, `last_write_s` the time until the step was
committed (known at `poll()` or `wait()`). A step in flight is not committed: `all_steps`,
`latest_step`, `restore` and `delete` wait for it first, and `close()` waits before releasing
Orbax, so a run that ends, or stops on SIGTERM / Ctrl-C, exits only after its last save is on disk.

State leaves should be arrays: jax arrays (any dtype, bf16 and int32 scalars included) or numpy
arrays. Keep the RNG as `jax.random.key_data(key)` (uint32) and the step and data position as
int32 jax scalars. Pytree nodes (dicts, NamedTuples such as optax states, registered
dataclasses) come back as the same node types because the structure is taken from the abstract
state given to `restore`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

_STATE, _META = "state", "meta"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or restored; the one-line message names the step and path."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    if len(line) > 300:
        line = line[:300] + "..."
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


# After a failed restore, TensorStore reads still in flight complete on native threads and call
# back into the asyncio loop (or executor) Orbax has already closed. Python reports each as an
# "unraisable" exception: tens of tracebacks on stderr around the one useful error line
# (measured: 0 to 20 per failed restore of a truncated manifest, orbax 0.12.8). Only these two
# messages are dropped; every other unraisable exception goes to the previous hook. The reads
# that failed too are logged by asyncio when their futures are collected ("Future exception was
# never retrieved", once in ~60 failed restores): copies of the error already raised, dropped
# when they carry a TensorStore spec.
_LATE_CALLBACK_ERRORS = ("Event loop is closed", "cannot schedule new futures after shutdown")


class _UnretrievedTensorStoreErrors(logging.Filter):
    def filter(self, record):
        msg = record.getMessage()
        return not ("exception was never retrieved" in msg and "tensorstore_spec" in msg)


def _drop_late_callback_errors() -> None:
    previous = sys.unraisablehook
    if getattr(previous, "_jaxmem_filter", False):
        return
    logging.getLogger("asyncio").addFilter(_UnretrievedTensorStoreErrors())

    def hook(unraisable):
        e = unraisable.exc_value
        if isinstance(e, RuntimeError) and str(e) in _LATE_CALLBACK_ERRORS:
            return
        previous(unraisable)

    hook._jaxmem_filter = True
    sys.unraisablehook = hook


def abstract_state(tree):
    """The restore target of `tree`: arrays become `jax.ShapeDtypeStruct`s (keeping a jax
    array's sharding), `ShapeDtypeStruct`s and other leaves stay as they are.

    A `ShapeDtypeStruct` without a sharding (e.g. from `jax.eval_shape`) restores onto this
    process's first device, whatever mesh saved it (restoring with the sharding recorded in the
    checkpoint fails with "Topology mismatch" on another device count); give one (a mesh's, see
    jaxmem.parallel.rules.with_shardings) to place it elsewhere.
    """
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, (np.ndarray, np.generic)):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype)  # restores as a numpy array
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
        return x
    return jax.tree.map(leaf, tree)


class Checkpointer:
    """Saves and restores (state pytree, meta dict) per step; keeps the newest `keep` steps.

        ckpt = Checkpointer("runs/x/ckpt", keep=3)
        ckpt.save(step, state, {"config": ..., "data": stats})
        step = ckpt.latest_step()                 # None when nothing was committed
        state, meta = ckpt.restore(step, jax.eval_shape(lambda: state))
        ckpt.close()
    """

    def __init__(self, directory, keep: int = 3):
        if not isinstance(keep, int) or keep < 1:
            raise CheckpointError(f"keep must be a positive integer, got {keep!r}")
        self.directory = Path(directory).absolute()
        try:
            self._manager = ocp.CheckpointManager(
                self.directory,
                item_names=(_STATE, _META),
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=keep, create=True, cleanup_tmp_directories=True),
            )
        except Exception as e:
            raise CheckpointError(
                f"cannot open checkpoint directory {self.directory}: {_first_line(e)}") from e
        self._in_flight: float | None = None  # perf_counter() at the start of an unfinished save
        self.last_pause_s: float | None = None
        self.last_write_s: float | None = None
        self._closed = False

    def _step_path(self, step: int) -> Path:
        return self.directory / str(step)

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first (a save in flight is waited for first)."""
        self.wait()
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None (a save in flight is waited for first; a killed
        save is never listed)."""
        self.wait()
        return self._manager.latest_step()

    def save(self, step: int, state, meta: dict[str, Any], wait: bool = True) -> float:
        """Save `state` (a pytree of arrays) and `meta` (a JSON-able dict) as `step`; returns
        the seconds the call held the caller (`last_pause_s`).

        With wait=False the files are written in a background thread once the arrays are on
        the host (see the module docstring): the caller may go on, donating the saved buffers
        included. The next `save`, `wait()` or `close()` waits for it; `poll()` tells when it
        committed.
        """
        step = int(step)
        path = self._step_path(step)
        try:
            json.dumps(meta, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint step {step} meta is not JSON-serializable "
                                  f"({_first_line(e)}); path {path}") from e
        self.wait()  # the previous save: its write time, and Orbax would wait anyway
        if step in self._manager.all_steps():
            raise CheckpointError(f"checkpoint step {step} already exists at {path}")
        start = time.perf_counter()
        try:
            saved = self._manager.save(step, args=ocp.args.Composite(**{
                _STATE: ocp.args.StandardSave(state),
                _META: ocp.args.JsonSave(meta),
            }))
        except Exception as e:
            raise CheckpointError(f"cannot save checkpoint step {step} to {path}: "
                                  f"{_first_line(e)}") from e
        if not saved:
            raise CheckpointError(f"Orbax declined to save checkpoint step {step} to {path}")
        self.last_pause_s, self.last_write_s = time.perf_counter() - start, None
        self._in_flight = start
        if wait:
            self.wait()
        return self.last_pause_s

    def poll(self) -> float | None:
        """The write time (s) of the save in flight once Orbax has committed it, else None.
        Cheap: no waiting (orbax without `is_saving_in_progress`: None until `wait()`)."""
        in_progress = getattr(self._manager, "is_saving_in_progress", None)
        if self._in_flight is None or in_progress is None or in_progress():
            return None
        return self.wait()

    def wait(self) -> float | None:
        """Block until a background save has committed; returns its write time (s), or None
        when no save was in flight."""
        if self._in_flight is None:
            return None
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._in_flight = None
            raise CheckpointError(f"background checkpoint save in {self.directory} failed: "
                                  f"{_first_line(e)}") from e
        self.last_write_s = time.perf_counter() - self._in_flight
        self._in_flight = None
        return self.last_write_s

    def restore(self, step: int, abstract) -> tuple[Any, dict[str, Any]]:
        """(state, meta) of committed `step`. `abstract` is a pytree with the state's structure
        whose leaves are `jax.ShapeDtypeStruct`s or arrays (see `abstract_state`); dtypes,
        shapes, shardings and node types come from it.

        Raises CheckpointError naming the step and path when the step was never committed or its
        files are missing, truncated or do not match `abstract`.
        """
        step = int(step)
        path = self._step_path(step)
        committed = self.all_steps()  # waits for a save in flight
        if step not in committed:
            raise CheckpointError(f"no committed checkpoint step {step} at {path} "
                                  f"(committed steps: {committed or 'none'})")
        _drop_late_callback_errors()  # the callbacks may fire before the exception reaches here
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**{
                _STATE: ocp.args.StandardRestore(abstract_state(abstract)),
                _META: ocp.args.JsonRestore(),
            }))
            state, meta = restored[_STATE], restored[_META]
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} at {path} is corrupted, incomplete or "
                                  f"does not match the expected state: {_first_line(e)}") from e
        if not isinstance(meta, dict):
            raise CheckpointError(f"checkpoint step {step} at {path} has no metadata dict "
                                  f"(got {type(meta).__name__})")
        return state, meta

    def delete(self, step: int) -> None:
        """Delete committed `step` (resuming from an older step replaces the later ones)."""
        self.wait()
        self._manager.delete(int(step))

    def close(self) -> None:
        """Wait for any background save to commit, then release Orbax's threads (once)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
