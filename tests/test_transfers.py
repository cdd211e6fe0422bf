"""The planner's host-resident state (--offload-optimizer / --offload-params host): what the
count puts on the host, what XLA:CPU's program takes as host arguments, and what the transfers
cost a step (jaxmem.memory.transfers)."""

import json
import math

import jax
import pytest

from jaxmem.families import get_preset
from jaxmem.memory.analytic import analytic_breakdown
from jaxmem.memory.compiled import compile_phase
from jaxmem.memory.counted import Where, abstract_state, count_state, nbytes
from jaxmem.memory.spec import StepSpec
from jaxmem.memory.transfers import format_transfers, transfer_plan
from jaxmem.model.precision import get_precision
from jaxmem.model.remat import RematPolicy
from jaxmem.paths import in_layers


def spec(optimizer="none", params="none", name="adamw8bit") -> StepSpec:
    return StepSpec.of(get_preset("tiny"), get_precision("bf16-sr"), RematPolicy("full"), 1, 128,
                       optimizer=name, in_backward=True, offload_optimizer=optimizer,
                       offload_params=params)


def offloaded(s: StepSpec) -> tuple[int, int]:
    """(bytes of the weights' stacked layer leaves, bytes of every optimizer-state array),
    read off the abstract state."""
    state = abstract_state(s)
    weights = sum(nbytes(x) for p, x in jax.tree_util.tree_leaves_with_path(state.params)
                  if in_layers(p))
    moments = sum(nbytes(x) for x in jax.tree_util.tree_leaves(state.opt_state) if x.ndim)
    return weights, moments


@pytest.mark.parametrize("optimizer,params", [("host", "none"), ("none", "host"),
                                              ("host", "host")])
def test_count_puts_the_offloaded_leaves_on_the_host(optimizer, params):
    s = spec(optimizer, params)
    weights, moments = offloaded(s)
    host = sum(x.bytes for x in count_state(s) if x.where is Where.HOST)
    assert host == (weights if params == "host" else 0) + (moments if optimizer == "host" else 0)
    # the device keeps the rest of the state: its whole bytes less the host's
    device = sum(x.bytes for x in count_state(s) if x.where is Where.DEVICE)
    assert device + host == sum(x.bytes for x in count_state(spec()))
    assert analytic_breakdown(s)["host_bytes"] == host


def test_nothing_offloaded_plans_no_transfers():
    assert transfer_plan(spec()) is None
    assert not [x for x in count_state(spec()) if x.where is Where.HOST]


def test_xla_cpu_takes_the_same_bytes_as_host_arguments():
    """The step compiled (XLA:CPU) with both flags: the arguments its entry layout puts in host
    memory (S(5)) are exactly the counted host bytes."""
    s = spec("host", "host")
    compiled = compile_phase("step", s)
    assert compiled["host_argument_bytes"] == sum(offloaded(s)) > 0


def test_transfer_plan_crossings():
    """Weights cross three times (in for the forward and the backward, out), the optimizer
    state twice. (Their seconds are the time model's: tests/test_timing.py.)"""
    s = spec("host", "host")
    weights, moments = offloaded(s)
    t = transfer_plan(s)
    assert t["host_bytes"] == weights + moments
    assert t["pcie_bytes"] == 3 * weights + 2 * moments
    assert math.isclose(json.loads(json.dumps(t))["pcie_bytes"], t["pcie_bytes"])
    text = "\n".join(format_transfers(t))
    assert "x3 over PCIe" in text and "x2 over PCIe" in text


def test_memory_cli_prints_the_host_and_transfer_plan(capsys):
    from jaxmem.memory.cli import main
    assert main(["--preset", "tiny", "--precision", "bf16-sr", "--optimizer", "adamw8bit",
                 "--remat", "full", "--optimizer-in-backward", "--offload-optimizer", "host",
                 "--offload-params", "host", "--batch-size", "1", "--seq-len", "128",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    s = spec("host", "host")
    assert r["transfers"]["host_bytes"] == r["analytic"]["host_bytes"] == sum(offloaded(s))
    assert r["compiled"]["host_argument_bytes"] == sum(offloaded(s))
    assert r["time"] is None  # no --target: a CPU program, no time
    assert any("MiB of pinned host memory besides" in line for line in r["verdict"])


def test_memory_cli_refuses_offload_without_in_backward(capsys):
    from jaxmem.memory.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--offload-params", "host"])
    assert e.value.code == 2
    assert "--offload-params host needs --optimizer-in-backward" in capsys.readouterr().err


@pytest.mark.parametrize("mesh", [None, "fsdp=2"])
def test_optimizer_on_the_host_without_in_backward(mesh):
    """--offload-optimizer host with the whole-tree 8-bit update (no --optimizer-in-backward), on
    one device and on an fsdp mesh of two simulated devices: XLA:CPU's program takes as host
    arguments exactly what the count puts on the host (per device), and the device's analytic
    peak is below the one without offload."""
    import subprocess
    import sys

    from testenv import ROOT, subprocess_env
    flags = ["--preset", "tiny", "--precision", "bf16-sr", "--optimizer", "adamw8bit",
             "--offload-optimizer", "host", "--batch-size", "2", "--seq-len", "128", "--json"]
    if mesh:
        flags += ["--mesh", mesh, "--devices", "2"]
    proc = subprocess.run([sys.executable, "-m", "jaxmem.memory", *flags], cwd=ROOT,
                          env=subprocess_env(cpu_devices=2 if mesh else 1), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    host = r["analytic"]["host_bytes"]
    assert host > 0 and r["compiled"]["host_argument_bytes"] == host
    moments = offloaded(spec("host", name="adamw8bit"))[1]
    # on the mesh each device holds its shard (small leaves whole: a little over half)
    assert host == moments if not mesh else moments / 2 <= host < moments
    if mesh:
        assert r["analytic"]["total_bytes"] < r["analytic_without_offload"]
