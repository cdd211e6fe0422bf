"""A tiny Gemma 3 (its local and global layers, every variation point of the family) on fsdp,
tensor and context meshes of simulated CPU devices trains as it does on one device (the worker:
tests/family_mesh_worker.py, one subprocess).

Tolerances as tests/test_parallel.py's fp32 meshes: per-step losses within 1e-5 relative, params
within 1e-4 absolute (reductions run in another order on a mesh)."""

import numpy as np
import pytest

from testenv import run_worker

MESHES = ("fsdp4", "fsdp2_tensor2", "context2_fsdp2")


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("family_mesh")
    run_worker("family_mesh_worker.py", out)
    return out


@pytest.mark.slow  # four placements of 5 tiny steps in one subprocess
@pytest.mark.parametrize("mesh", MESHES)
def test_gemma3_on_a_mesh_trains_as_on_one_device(worker, mesh):
    one, sharded = (dict(np.load(worker / f"{n}.npz")) for n in ("single", mesh))
    assert one["losses"][-1] < one["losses"][0]  # it trained
    np.testing.assert_allclose(sharded["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(sharded["params"], one["params"], rtol=0, atol=1e-4)
