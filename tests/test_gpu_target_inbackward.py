"""--optimizer-in-backward on the H100's own compiler without a GPU (jaxmem.target): the
gradient tree gone from the step's temporaries, through jaxmem's own planner command.

llama-3-8b's widths and vocabulary with 8 layers (the issue's 8-layer variant), bf16-sr +
adamw8bit, remat full, 1 x 2048: the ordinary step's temp holds every bf16 gradient; with the
flag, one layer's, the head's and the saved layer inputs. The whole llama-3-8b is in
docs/memory.md (35.14 GiB, from 49.03)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testenv import ROOT, subprocess_env

pytestmark = pytest.mark.gpu_target


def plan(*flags):
    cmd = [sys.executable, "-m", "jaxmem.memory", "--preset", "llama-3-8b", "--num-layers", "8",
           "--precision", "bf16-sr", "--optimizer", "adamw8bit", "--remat", "full",
           "--batch-size", "1", "--seq-len", "2048", "--target", "h100", "--json", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(cpu=True), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["backend"] == "gpu" and "NVIDIA H100" in r["compiler"]
    return r


def test_optimizer_in_backward_drops_the_gradient_tree_from_the_h100_step():
    ordinary, oib = plan(), plan("--optimizer-in-backward")
    grads = 2 * ordinary["params"]  # the bf16 gradient tree
    a, b = ordinary["compiled"], oib["compiled"]
    assert a["argument_bytes"] == b["argument_bytes"]  # the same state
    batch = 3 * 2048 * 4  # inputs, targets, mask: the one argument not donated
    assert b["argument_bytes"] - b["alias_bytes"] == batch  # the state updated in place
    assert a["temp_bytes"] > grads  # today's step holds every gradient
    assert a["temp_bytes"] - b["temp_bytes"] > 0.8 * grads
    # what is left: the head's bf16 gradient [D, V] (the largest), the saved layer inputs, one
    # layer's working set; no params- or gradient-tree-sized buffer
    head = 2 * 4096 * 128_256
    assert b["temp_bytes"] < 2.5 * head
