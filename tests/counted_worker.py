"""Runs on 4 simulated CPU devices in a subprocess of tests/test_counted.py (the test process's
JAX has already started with one device):

    python tests/counted_worker.py OUT.json [PRESET,...]

For every row of test_counted's matrix on fsdp=4: the step's arguments placed as the
placement splits them, and for the presets named (default: tiny and small) the step compiled
(test_counted.measure).
OUT.json: {preset: {mode: {"placed": {...}, "compiled": {...} or null}}}. The test counts and
asserts; this script only measures.
"""

import json
import sys

from testenv import worker_jax

jax = worker_jax(4)  # 4 simulated CPU devices, precision highest, the suite's compile cache
from test_counted import COMPILED, MESH, measure  # noqa: E402  (after the environment above)

if __name__ == "__main__":
    assert jax.device_count() == 4, jax.devices()
    compiled = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else COMPILED
    with open(sys.argv[1], "w") as f:
        json.dump(measure(MESH, compiled=compiled), f)
