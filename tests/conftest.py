"""The suite's backend-awareness and shared fixtures.

- Before JAX starts: tests/testenv.py's TEST_ENV (matmul precision `highest`, no GPU
  preallocation, deterministic GPU ops) goes into os.environ, so this process, every xdist
  worker and every subprocess a test or the library starts get it.
- Markers (pyproject.toml): `gpu` and `torch` skip where there is no GPU / no PyTorch;
  `cpu_only(reason=...)` skips a check of a fact of the CPU backend (bf16 emulated, no cuDNN,
  no allocator stats) on any other backend, with its reason; `slow` is left out of the default
  selection (`-m "not slow"` in addopts; `-m "slow or not slow"` runs everything, as
  .ci/nightly does); `nightly` (a costlier repeat of a claim a cheaper test checks) is slow too,
  and CI (.ci/run, `-m "not nightly"`) leaves it out;
  `reordered` is added at collection to the tests that compare fp32 results in another
  summation order or run torch (tests/kernel_sweep.sh).
"""

import importlib.util
import os
import tempfile
from pathlib import Path

from testenv import with_test_env

os.environ.update(with_test_env(os.environ))

import jax  # noqa: E402  (after the environment above: JAX reads it when it starts)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Many tests compile the same small train step; XLA's persistent cache (keyed on the program)
# turns the repeats into cache hits. Subprocesses inherit it through the environment.
_CACHE = os.path.join(tempfile.gettempdir(), "jaxmem-test-xla-cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _gpu_target_missing() -> str | None:
    """Why `gpu_target` tests cannot run here (the gpu-plan extra is missing), or None."""
    from jaxmem import target
    try:
        target.check_installed()
    except target.TargetError as e:
        return str(e)
    return None


def _compares_reordered(function, module, depth: int = 2) -> bool:
    """`function` calls tests/numerics.py's assert_reordered_fp32, itself or through a function
    of its module (up to `depth` calls deep)."""
    code = getattr(function, "__code__", None)
    if code is None:
        return False
    names = set(code.co_names)
    for const in code.co_consts:  # nested functions and lambdas
        if hasattr(const, "co_names"):
            names |= set(const.co_names)
    if "assert_reordered_fp32" in names:
        return True
    return depth > 0 and any(
        _compares_reordered(getattr(module, n), module, depth - 1) for n in names
        if callable(getattr(module, n, None))
        and getattr(getattr(module, n), "__module__", None) == module.__name__)


def pytest_itemcollected(item):
    """`reordered`: a test that compares two fp32 computations adding in different orders
    (tests/numerics.py's assert_reordered_fp32, called by the test or a helper of its module) or
    runs torch's kernels; tests/kernel_sweep.sh runs these under other kernels. Marked here, at
    collection, so that `-m reordered` selects them. A `nightly` test is `slow` too: the
    README's default selection leaves it out as CI does."""
    if "nightly" in item.keywords and "slow" not in item.keywords:
        item.add_marker(pytest.mark.slow)
    module = getattr(item, "module", None)
    function = getattr(item, "function", None)
    if "torch" in item.keywords or (
            hasattr(module, "assert_reordered_fp32") and _compares_reordered(function, module)):
        item.add_marker(pytest.mark.reordered)


def pytest_collection_modifyitems(config, items):
    # `slow` tests first (a stable sort: each keeps its place among its kind), so that pytest-xdist
    # hands the minutes-long ones out while both workers are fresh and the short tests fill the
    # end: in collection order a 2-minute test could start last and leave one worker idle.
    # .ci/run distributes whole modules (`--dist loadscope`), so a module-scoped fixture (a
    # worker on 8 simulated devices: up to 2 minutes) is built once, not once per worker; with
    # this order the modules that hold slow tests are handed out first. (`--dist loadgroup` and
    # `xdist_group` would be finer, but pytest-xdist 3.8 marks a group by rewriting
    # `item._nodeid`, which pytest 9 no longer reads: the groups are silently ignored.)
    items.sort(key=lambda item: "slow" not in item.keywords)
    has_torch = importlib.util.find_spec("torch") is not None
    no_target = _gpu_target_missing() if any("gpu_target" in i.keywords for i in items) else None
    backend = jax.default_backend()
    for item in items:
        if "torch" in item.keywords and not has_torch:
            item.add_marker(pytest.mark.skip(reason="PyTorch is not installed"))
        if "gpu_target" in item.keywords and no_target:
            item.add_marker(pytest.mark.skip(reason=no_target))
        if "gpu" in item.keywords and backend != "gpu":
            item.add_marker(pytest.mark.skip(reason="no GPU"))
        mark = item.get_closest_marker("cpu_only")
        if mark is not None:
            reason = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "")
            if not reason:
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.cpu_only needs a reason")
            if backend != "cpu":
                item.add_marker(pytest.mark.skip(
                    reason=f"a fact of the CPU backend (this is {backend}): {reason}"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small text corpus (fast to load) with one invalid UTF-8 byte."""
    d = tmp_path_factory.mktemp("corpus")
    src = Path(np.__file__).read_text()[:60000]
    (d / "a.txt").write_text(src[:30000])
    (d / "b.txt").write_bytes(src[30000:].encode() + b"\xff tail")
    return str(d)
