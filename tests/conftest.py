import importlib.util
import os
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

# Many tests compile the same small train step; XLA's persistent cache (keyed on the program)
# turns the repeats into cache hits. Subprocesses inherit it through the environment.
_CACHE = os.path.join(tempfile.gettempdir(), "jaxmem-test-xla-cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_collection_modifyitems(config, items):
    has_torch = importlib.util.find_spec("torch") is not None
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    for item in items:
        if "torch" in item.keywords and not has_torch:
            item.add_marker(pytest.mark.skip(reason="PyTorch is not installed"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="no GPU"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small text corpus (fast to load) with one invalid UTF-8 byte."""
    d = tmp_path_factory.mktemp("corpus")
    src = Path(np.__file__).read_text()[:60000]
    (d / "a.txt").write_text(src[:30000])
    (d / "b.txt").write_bytes(src[30000:].encode() + b"\xff tail")
    return str(d)
