"""`--update-kernel pallas` compiled for an H100 that is not here (jaxmem.target): the 8-bit
update of a leaf is one Triton kernel that moves each element's bytes once, where XLA's loop of
row pieces moves ~40 bytes per element, and the kernel's name carries its arithmetic for the
time model (jaxmem.xla.alu). Its numbers on a GPU: tests/test_update_kernel.py's gpu test."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from jaxmem import target
from jaxmem.optim import AdamW8bitInPlace
from jaxmem.xla import alu
from jaxmem.xla.hlo import parse_hlo
from jaxmem.xla.timing import Efficiency, Machine, step_time

pytestmark = pytest.mark.gpu_target

SHAPE = (4, 14336, 4096)  # four layers of llama-3-8b's MLP down projection


EMBED = (128256, 4096)  # llama-3-8b's embedding: fp32 moments (the trainer's keeps_fp32)


@functools.lru_cache(maxsize=None)  # each program compiles once
def _compiled(kernel: str, shape=SHAPE, fp32_moments: bool = False) -> str:
    opt = AdamW8bitInPlace(3e-4, weight_decay=0.1, clip_norm=1.0, stochastic_rounding=True,
                           layer_axes=lambda path, x: 1 if x.ndim == 3 else 0,
                           keep_fp32=(lambda path, x: True) if fp32_moments else None,
                           update_kernel=kernel)
    params = {"w": jax.ShapeDtypeStruct(shape, jnp.bfloat16)}
    state = jax.eval_shape(opt.init, params)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    step = jax.jit(lambda g, s, p, k: opt.update_and_apply(g, s, p, key=k), donate_argnums=(1, 2))
    with target.compiling_for("h100"):
        return step.lower(params, state, params, key).compile().as_text()


def test_the_update_is_one_triton_kernel_that_moves_each_byte_once():
    elements = SHAPE[0] * SHAPE[1] * SHAPE[2]
    machine = Machine.of_card(target.card("h100"))
    times = {k: step_time(_compiled(k), machine, Efficiency()) for k in ("xla", "pallas")}
    moved = {k: sum(x.bytes * x.runs for x in t.kernels) / elements for k, t in times.items()}
    # the gradient read twice (its norm for clipping, then the update), the weight read and
    # written, each code read and written, the scales: 12 B per element; XLA's loop ~41
    assert 11.5 < moved["pallas"] < 13 and moved["xla"] > 35, moved
    assert times["pallas"].seconds < 0.4 * times["xla"].seconds
    calls = [i for c in parse_hlo(_compiled("pallas")).values() for i in c["instrs"].values()
             if i["op"] == "custom-call" and "triton" in i["attrs"]]
    assert len(calls) == 1
    cycles = alu.tagged(alu.kernel_name(calls[0]["attrs"]))
    assert cycles is not None and 300 < cycles < 900, cycles  # threefry alone is ~155
    kernel = next(k for k in times["pallas"].kernels if "pallas" in k.name)
    assert kernel.arithmetic == pytest.approx(cycles * elements / machine.lane_cycles)


def test_an_fp32_moment_leaf_is_one_triton_kernel_too():
    """The embedding's update: the gradient read twice (the clip's norm, then the update: 4 B),
    the weight read and written (4 B), each fp32 moment read and written (16 B): 24 B per
    element, 22 of them the kernel's; XLA's loop 48."""
    elements = EMBED[0] * EMBED[1]
    machine = Machine.of_card(target.card("h100"))
    moved = {k: sum(x.bytes * x.runs for x in step_time(
        _compiled(k, EMBED, True), machine, Efficiency()).kernels) / elements
        for k in ("xla", "pallas")}
    assert 23.5 < moved["pallas"] < 25 and moved["xla"] > 40, moved
    calls = [i for c in parse_hlo(_compiled("pallas", EMBED, True)).values()
             for i in c["instrs"].values() if i["op"] == "custom-call" and "triton" in i["attrs"]]
    assert len(calls) == 1


def test_a_leaf_the_kernel_does_not_take_compiles_as_before():
    """fp32 weights: the kernel is not eligible, and the program is XLA's loop unchanged."""
    opt = AdamW8bitInPlace(3e-4, layer_axes=lambda path, x: 1, update_kernel="pallas")
    params = {"w": jax.ShapeDtypeStruct((2, 4096, 4096), jnp.float32)}
    state = jax.eval_shape(opt.init, params)
    step = jax.jit(lambda g, s, p: opt.update_and_apply(g, s, p))
    ref = jax.jit(lambda g, s, p: dataclasses.replace(opt, update_kernel="xla").update_and_apply(
        g, s, p))
    with target.compiling_for("h100"):
        a = step.lower(params, state, params).as_text()
        b = ref.lower(params, state, params).as_text()
    assert "pallas" not in a and a == b
