"""Checkpoints: bitwise round trips of a realistic train state, atomic saves, corruption errors."""

import dataclasses
import functools
import gc
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmem.io.checkpoint import Checkpointer, CheckpointError, abstract_state
from testenv import subprocess_env

REPO = Path(__file__).resolve().parents[1]

# After a restore fails on a damaged file, Orbax leaves sibling read coroutines whose errors are
# never retrieved; Python reports them as unraisable. They are expected in the corruption tests.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture
def quiet_asyncio():
    """Orbax's orphaned read tasks also log 'Task exception was never retrieved' when they are
    collected; silence that logger while a corruption test runs."""
    logger = logging.getLogger("asyncio")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    gc.collect()  # reap the orphaned coroutines here, under the warning filter above
    logger.setLevel(level)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossScale:  # the shape of the lead's loss-scale state: array leaves plus a static field
    scale: jax.Array
    good_steps: jax.Array
    period: int = dataclasses.field(default=2000, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class State:
    step: jax.Array
    params: dict
    opt_state: optax.OptState
    loss_scale: LossScale
    rng: jax.Array
    data_position: jax.Array


@functools.lru_cache(maxsize=None)  # jax arrays are immutable: sharing them is safe
def make_state(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    special = jnp.array([np.nan, -0.0, np.inf, -np.inf, 1e-45, 3.4e38, -1.5, 0.1], jnp.float32)
    params = {
        "embed": jax.random.normal(k[0], (16, 8), jnp.float32).at[0].set(special),
        "layers": {"w": jax.random.normal(k[1], (2, 8, 8), jnp.float32).astype(jnp.bfloat16),
                   "norm": jnp.ones((2, 8), jnp.bfloat16) * 1.0078125},
    }
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)))
    opt_state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.nan_to_num(p * 0.5, posinf=1.0, neginf=-1.0), params)
    update = jax.jit(tx.update)
    for _ in range(3):  # non-zero moments and counts
        _, opt_state = update(grads, opt_state, params)
    return State(step=jnp.int32(3), params=params, opt_state=opt_state,
                 loss_scale=LossScale(jnp.float32(2.0 ** 15), jnp.int32(1999), period=123),
                 rng=jax.random.key_data(k[3]), data_position=jnp.int32(2 ** 31 - 1))


def assert_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


META = {"config": {"preset": "tiny", "lr": 1e-3}, "data": {"tokens": 123, "sha": "ab"},
        "note": "ünïcode", "nan": None}


@pytest.fixture
def saved(tmp_path):
    state = make_state()
    with Checkpointer(tmp_path / "ckpt", keep=3) as ck:
        ck.save(1, make_state(1), {"n": 1})
        ck.save(2, state, META)
    return tmp_path / "ckpt", state


def test_round_trip_bitwise_with_structure(saved):
    directory, state = saved
    ck = Checkpointer(directory, keep=3)  # a fresh manager finds the committed steps
    assert ck.all_steps() == [1, 2] and ck.latest_step() == 2
    for target in [jax.eval_shape(lambda: state), state, abstract_state(state)]:
        restored, meta = ck.restore(2, target)
        assert meta == META
        assert_bitwise_equal(restored, state)
        assert isinstance(restored, State) and isinstance(restored.loss_scale, LossScale)
        assert restored.loss_scale.period == 123  # static field comes from the abstract tree
        adam = restored.opt_state[1][0]
        assert isinstance(adam, optax.ScaleByAdamState) and adam.count.dtype == jnp.int32
        assert int(adam.count) == 3 and int(restored.data_position) == 2 ** 31 - 1
        assert restored.params["layers"]["w"].dtype == jnp.bfloat16
        assert isinstance(restored.params["embed"], jax.Array)
        key = jax.random.wrap_key_data(restored.rng)  # the RNG resumes exactly
        np.testing.assert_array_equal(jax.random.key_data(jax.random.split(key)),
                                      jax.random.key_data(jax.random.split(
                                          jax.random.wrap_key_data(state.rng))))
    ck.close()


def test_keep_wait_and_errors(tmp_path):
    ck = Checkpointer(tmp_path / "c", keep=2)
    assert ck.latest_step() is None and ck.all_steps() == []
    state = make_state()
    for step in [10, 20, 30]:
        ck.save(step, state, {"step": step}, wait=False)
    ck.wait()
    assert ck.all_steps() == [20, 30] and ck.latest_step() == 30
    assert ck.restore(30, state)[1] == {"step": 30}
    with pytest.raises(CheckpointError, match=r"checkpoint step 30 already exists at .*c/30"):
        ck.save(30, state, {})
    with pytest.raises(CheckpointError, match=r"no committed checkpoint step 10 at .*c/10 "
                                              r"\(committed steps: \[20, 30\]\)"):
        ck.restore(10, state)
    with pytest.raises(CheckpointError, match=r"step 40 meta is not JSON-serializable"):
        ck.save(40, state, {"x": object()})
    wrong = dataclasses.replace(state, params={"embed": state.params["embed"]})
    with pytest.raises(CheckpointError, match=r"checkpoint step 30 at .*c/30 is corrupted, "
                                              r"incomplete or does not match"):
        ck.restore(30, wrong)
    ck.close()
    with pytest.raises(CheckpointError, match="keep must be a positive integer"):
        Checkpointer(tmp_path / "d", keep=0)


# ----------------------------------------------------------------------------- corruption


def _corrupt_and_restore(directory, state, corrupt, check_step_1=True):
    step_dir = directory / "2"
    corrupt(step_dir)
    ck = Checkpointer(directory, keep=3)
    try:
        if ck.latest_step() != 2:  # Orbax no longer lists the step: also a clean outcome
            return "unlisted", ck.restore(1, make_state(1))
        try:
            restored, meta = ck.restore(2, state)
        except CheckpointError as e:
            msg = str(e)
            assert "\n" not in msg
            assert msg.startswith(f"checkpoint step 2 at {step_dir} "), msg
            if check_step_1:  # the older step is untouched and still restores
                assert_bitwise_equal(ck.restore(1, make_state(1))[0], make_state(1))
            return "error", msg
        return "restored", (restored, meta)
    finally:
        ck.close()


def _files(step_dir):
    return sorted(p for p in step_dir.rglob("*") if p.is_file())


@pytest.mark.parametrize("what", ["state metadata", "meta item", "meta dir", "state dir",
                                  "truncate data"])
def test_corrupted_checkpoint_raises_naming_step_and_path(saved, what, quiet_asyncio):
    directory, state = saved

    def corrupt(step_dir):
        if what == "state metadata":
            if not (step_dir / "state" / "_METADATA").exists():
                pytest.skip(f"this Orbax version writes no state/_METADATA: {_files(step_dir)}")
            (step_dir / "state" / "_METADATA").unlink()
        elif what == "meta item":
            (step_dir / "meta" / "metadata").unlink()
        elif what == "meta dir":
            shutil.rmtree(step_dir / "meta")
        elif what == "state dir":
            shutil.rmtree(step_dir / "state")
        else:  # every file of the state item cut in half
            for f in _files(step_dir / "state"):
                if f.name != "commit_success.txt":
                    os.truncate(f, f.stat().st_size // 2)

    outcome, _ = _corrupt_and_restore(directory, state, corrupt)
    assert outcome == "error"


def test_any_single_file_removed_or_truncated_never_gives_wrong_state(saved, tmp_path,
                                                                    quiet_asyncio):
    """Whatever file of step 2 is damaged: a CheckpointError naming step and path, or (for
    files Orbax does not need, e.g. commit markers) exactly the saved state. Never other data,
    never another exception type."""
    directory, state = saved
    pristine = tmp_path / "pristine"
    shutil.copytree(directory / "2", pristine)
    outcomes = []
    for i, rel in enumerate(p.relative_to(pristine) for p in _files(pristine)):
        for action in ["remove", "truncate"]:
            shutil.rmtree(directory / "2")
            shutil.copytree(pristine, directory / "2")

            def corrupt(step_dir):
                f = step_dir / rel
                f.unlink() if action == "remove" else os.truncate(f, f.stat().st_size // 2)

            outcome, value = _corrupt_and_restore(directory, state, corrupt, check_step_1=False)
            if outcome == "restored":
                assert_bitwise_equal(value[0], state)
                assert value[1] == META
            outcomes.append(outcome)
    assert outcomes.count("error") >= 4, outcomes


# ----------------------------------------------------------------------------- kill mid-save


CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from jaxmem.io.checkpoint import Checkpointer
    small = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": np.int32(1)}
    big = {f"x{i}": np.random.default_rng(i).random(16_000_000, dtype=np.float32)
           for i in range(8)}  # 512 MB: the write takes long enough to be killed in the middle
    big["step"] = np.int32(2)
    ck = Checkpointer(sys.argv[1], keep=5)
    ck.save(1, small, {"step": 1})
    print("saved 1", flush=True)
    ck.save(2, big, {"step": 2})
    print("saved 2", flush=True)
""")


def test_sigkill_during_save_keeps_last_committed_step(tmp_path):
    directory = tmp_path / "ckpt"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory)],
                             env=subprocess_env(cpu=True),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert child.stdout.readline().strip() == "saved 1"
        deadline = time.monotonic() + 60
        tmp_seen = False
        while time.monotonic() < deadline and child.poll() is None:
            names = os.listdir(directory)
            if any(n.startswith("2.orbax-checkpoint-tmp") for n in names):
                tmp_seen = True
                break
            time.sleep(0.001)
        assert tmp_seen, f"never saw step 2 being written: {os.listdir(directory)}"
        time.sleep(0.05)  # a little way into the write
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    names = os.listdir(directory)
    # the kill landed mid-write: step 2 exists only as an uncommitted tmp directory
    assert "2" not in names and any(n.startswith("2.orbax-checkpoint-tmp") for n in names)

    ck = Checkpointer(directory, keep=5)
    assert ck.all_steps() == [1] and ck.latest_step() == 1
    abstract = {"w": jax.ShapeDtypeStruct((3, 4), jnp.float32),
                "step": jax.ShapeDtypeStruct((), jnp.int32)}
    state, meta = ck.restore(1, abstract)
    assert meta == {"step": 1}
    np.testing.assert_array_equal(state["w"], np.arange(12, dtype=np.float32).reshape(3, 4))
    assert int(state["step"]) == 1
    with pytest.raises(CheckpointError, match=r"no committed checkpoint step 2"):
        ck.restore(2, abstract)
    # the run resumes and saves step 2 again over the leftover tmp directory
    ck.save(2, {"w": state["w"] + 1, "step": jnp.int32(2)}, {"step": 2})
    assert ck.latest_step() == 2 and ck.restore(2, abstract)[1] == {"step": 2}
    ck.close()
    assert not [n for n in os.listdir(directory) if re.search(r"orbax-checkpoint-tmp", n)]


# ----------------------------------------------------------------------------- asynchronous saves

def test_async_save_lets_the_caller_donate_the_buffers_and_commits_the_saved_values(tmp_path):
    """save(wait=False) returns once the arrays are on the host: the train step may donate the
    state while Orbax writes, and the step restores to the values at the save."""
    state = jax.tree.map(jnp.copy, make_state(2))  # fresh buffers: this test donates them
    host = jax.tree.map(np.array, state)
    abstract = jax.eval_shape(lambda: state)
    ck = Checkpointer(tmp_path / "c", keep=2)
    pause = ck.save(5, state, {"step": 5}, wait=False)
    assert pause == ck.last_pause_s and pause >= 0 and ck.last_write_s is None
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1 if x.dtype != jnp.uint32 else x, s),
                   donate_argnums=0)
    for _ in range(3):  # what the loop does next: the saved buffers are donated
        state = step(state)
    jax.block_until_ready(state)
    write = ck.wait()
    assert write is not None and write >= pause and ck.last_write_s == write
    assert ck.wait() is None  # nothing in flight any more
    assert ck.all_steps() == [5]
    restored, meta = ck.restore(5, abstract)
    assert_bitwise_equal(restored, host)
    assert meta == {"step": 5}
    ck.close()
    ck.close()  # closing twice is harmless


def test_a_step_in_flight_is_listed_only_once_committed(tmp_path):
    ck = Checkpointer(tmp_path / "c", keep=3)
    ck.save(1, make_state(), {"step": 1}, wait=False)
    # listing waits for the write: whatever it lists is committed on disk
    assert ck.latest_step() == 1 and ck.last_write_s is not None
    assert (tmp_path / "c" / "1").is_dir()
    assert not [p for p in os.listdir(tmp_path / "c") if "tmp" in p]
    ck.save(2, make_state(), {"step": 2}, wait=False)
    while ck.poll() is None:  # poll never blocks; it gives the write time once committed
        time.sleep(0.01)
    assert ck.last_write_s is not None and (tmp_path / "c" / "2").is_dir()
    ck.close()


# ------------------------------------------------------------------- restore into target types

def test_restore_into_the_targets_dtypes_and_shardings(tmp_path):
    """Leaves come back in the abstract state's dtypes and on its shardings (here a one-device
    mesh's NamedSharding; multi-device meshes: tests/test_parallel.py), not as saved."""
    state = make_state()
    ck = Checkpointer(tmp_path / "c")
    ck.save(1, state, {}, wait=True)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named), state)
    restored, _ = ck.restore(1, target)
    for x, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
        assert isinstance(x, jax.Array) and x.dtype == t.dtype and x.sharding == named
    assert_bitwise_equal(restored, state)
    # a bf16 leaf is restored as bf16, as the target says
    assert restored.params["layers"]["w"].dtype == jnp.bfloat16
    ck.close()
