"""jaxmem.memory.analyze: XLA's memory plan of any jittable function, and the residuals of a
backward, grouped (jaxmem/memory/analysis.py)."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.memory import MemoryAnalysis, analyze
from testenv import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
f32 = jnp.float32


def test_import_loads_no_trainer_torch_or_matplotlib():
    code = ("import sys\nfrom jaxmem.memory import analyze, MemoryAnalysis\n"
            "import json; print(json.dumps(sorted(m for m in sys.modules)))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=subprocess_env(cpu=True))
    assert p.returncode == 0, p.stderr[-2000:]
    loaded = set(json.loads(p.stdout.splitlines()[-1]))
    heavy = {m for m in loaded if m.split(".")[0] in ("torch", "transformers", "matplotlib", "flax")
             or m.startswith(("jaxmem.train", "jaxmem.model", "jaxmem.config"))}
    assert not heavy, sorted(heavy)
    assert {"jaxmem.xla.analysis", "jax"} <= loaded


def test_agrees_with_jaxmem_memory_compile_step_to_the_byte():
    """The tiny preset's full train step (state donated): analyze on the jitted step gives
    compile_step's figures (its own compile) and the ones XLA reports for the same executable
    (read here directly)."""
    from jaxmem.families import get_preset
    from jaxmem.memory.compiled import (abstract_frozen, abstract_state, abstract_step_batch,
                                        compile_step)
    from jaxmem.memory.spec import StepSpec
    from jaxmem.model.remat import RematPolicy
    from jaxmem.model.precision import get_precision
    from jaxmem.train.step import jit_train_step

    spec = StepSpec.of(get_preset("tiny", num_layers=1), get_precision("fp32"), RematPolicy(), 2, 32)
    args = (abstract_state(spec), abstract_step_batch(spec), abstract_frozen(spec))
    step = jit_train_step(spec.step_config()[0])
    raw = step.lower(*args).compile().memory_analysis()
    expected = compile_step(spec)
    a = analyze(step, *args)
    assert a.stats() == {k: expected[k] for k in a.stats()} and a.flops == expected["flops"]
    assert (a.temp_bytes, a.argument_bytes, a.output_bytes, a.alias_bytes) == (
        raw.temp_size_in_bytes, raw.argument_size_in_bytes, raw.output_size_in_bytes,
        raw.alias_size_in_bytes)
    assert a.alias_bytes > 0 and a.devices == 1  # the state is donated


def _mlp_loss(params, x):
    """Two remat'd layers that save only the value named 'hidden' ([B, F] per layer)."""
    policy = jax.checkpoint_policies.save_only_these_names("hidden")

    @jax.checkpoint
    def layer(h, w):
        w1, w2 = w
        a = jax.ad_checkpoint.checkpoint_name(jnp.tanh(h @ w1), "hidden")  # [B, F]
        return h + jnp.tanh(a) @ w2  # [B, D]

    layer = jax.checkpoint(layer.__wrapped__, policy=policy)
    for w in params:
        x = layer(x, w)
    return jnp.sum(x ** 2)


def test_residuals_grouped_by_name_shape_dtype():
    B, D, F = 4, 16, 64
    params = [(jax.ShapeDtypeStruct((D, F), f32), jax.ShapeDtypeStruct((F, D), f32))] * 2
    x = jax.ShapeDtypeStruct((B, D), f32)
    a = analyze(jax.value_and_grad(_mlp_loss), params, x, residuals_of=_mlp_loss)
    named = [r for r in a.residuals if r.name == "named 'hidden'"]
    assert [(r.shape, r.dtype, r.count, r.bytes) for r in named] == [((B, F), "float32", 2,
                                                                      2 * B * F * 4)]
    assert a.residuals_of == "_mlp_loss"
    # the total agrees with jaxmem.xla.residuals' count (arguments left out of both)
    from jaxmem.xla.residuals import saved_residual_bytes
    assert a.residual_bytes == saved_residual_bytes(_mlp_loss, params, x).bytes
    assert all(r.argument == r.name.startswith("argument ") for r in a.residuals)
    text = a.report()
    assert "saved for the backward of _mlp_loss" in text and "named 'hidden'" in text
    assert f"[{B}, {F}]" in text


def test_static_args_kwargs_and_options():
    def f(x, *, n):
        return jnp.tile(x, (n, 1))  # [n*B, D]
    x = jax.ShapeDtypeStruct((8, 32), f32)
    a = analyze(f, x, n=3, jit_options={"static_argnames": "n"})
    assert (a.argument_bytes, a.output_bytes) == (8 * 32 * 4, 3 * 8 * 32 * 4)
    # donation passed through jit_options: the output is written over the donated input
    d = analyze(lambda s, x: s + x, x, x, jit_options={"donate_argnums": 0})
    assert (d.alias_bytes, d.output_bytes, d.peak_bytes - d.temp_bytes) == (1024, 1024, 2048)
    with pytest.raises(TypeError, match="already jitted"):
        analyze(jax.jit(f, static_argnames="n"), x, n=3, jit_options={"donate_argnums": 0})
    # residual_args: the differentiated function takes other arguments than the step
    loss = lambda w, x: jnp.sum(jnp.sin(x @ w))  # noqa: E731
    step = lambda state, x: jax.tree.map(lambda p, g: p - g, state, jax.grad(loss)(state, x))  # noqa: E731
    w = jax.ShapeDtypeStruct((32, 32), jnp.bfloat16)
    xb = jax.ShapeDtypeStruct((8, 32), jnp.bfloat16)
    b = analyze(step, w, xb, residuals_of=loss, residual_args=(w, xb), name="sgd")
    assert b.name == "sgd" and b.precision == "bfloat16"
    assert b.residual_bytes == 8 * 32 * 2  # cos(xw), the derivative of sin, kept for dL/dw
    assert b.output_bytes == 32 * 32 * 2


def test_verdict_lines_as_the_cli_prints_them(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    a = MemoryAnalysis("step", "gpu", jax.__version__, 1, argument_bytes=20 * 2**30,
                       output_bytes=20 * 2**30, alias_bytes=20 * 2**30, temp_bytes=30 * 2**30)
    assert a.peak_bytes == 50 * 2**30
    assert a.verdict("80GiB").splitlines()[0] == (
        "verdict: compiled peak 50.00 GiB fits on every common GPU size (80 GiB)")
    assert a.verdict(40 * 2**30).splitlines()[0] == (
        "verdict: compiled peak 50.00 GiB does not fit on any common GPU size (40 GiB)")
    assert a.verdict().splitlines()[0] == (  # 0.75 x 80 = 60 GiB usable; 0.75 x 141
        "verdict: compiled peak 50.00 GiB fits on 80 GiB, 141 GiB; does not fit on 12 GiB, "
        "16 GiB, 24 GiB, 40 GiB")
    assert "79.16 GiB" in a.verdict("85GB")  # 85e9 bytes
    cpu16 = MemoryAnalysis("step", "cpu", "", 1, 0, 0, 0, 2**20, precision="bfloat16")
    assert "compiled by XLA:CPU: not a GPU's program" in cpu16.verdict("24GiB")
    assert "--target h100" in cpu16.verdict("24GiB")
    assert "XLA:CPU" not in MemoryAnalysis("s", "gpu", "", 1, 0, 0, 0, 1).verdict()
    for bad in ("80 parsecs", "-3GiB", "", 2.5):
        with pytest.raises(ValueError, match="device"):
            a.verdict(bad)


def test_per_device_under_a_mesh():
    """4 simulated CPU devices: the figures are per device (argument sharded 4 ways)."""
    code = """
import json, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
from jaxmem.memory import analyze
mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Auto,))
x = jax.ShapeDtypeStruct((1024, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
a = analyze(lambda x: jnp.tanh(x) * 2, x)
one = analyze(lambda x: jnp.tanh(x) * 2, jax.ShapeDtypeStruct((1024, 256), jnp.float32))
print(json.dumps([a.devices, a.argument_bytes, a.output_bytes, one.devices, one.argument_bytes]))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=subprocess_env(cpu_devices=4))
    assert p.returncode == 0, p.stderr[-2000:]
    devices, arg, out, one_devices, one_arg = json.loads(p.stdout.splitlines()[-1])
    total = 1024 * 256 * 4
    assert (devices, arg, out) == (4, total // 4, total // 4)
    assert (one_devices, one_arg) == (1, total)


def test_plot_without_matplotlib_says_so(monkeypatch, tmp_path):
    a = analyze(lambda x: x * 2, jax.ShapeDtypeStruct((4,), f32))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'jaxmem\[plot\]'"):
        a.plot(tmp_path / "m.png")


def test_plot_writes_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    B, D, F = 4, 16, 64
    params = [(jax.ShapeDtypeStruct((D, F), f32), jax.ShapeDtypeStruct((F, D), f32))] * 2
    a = analyze(jax.grad(_mlp_loss), params, jax.ShapeDtypeStruct((B, D), f32),
                residuals_of=_mlp_loss)
    out = a.plot(tmp_path / "m.png")
    assert Path(out).stat().st_size > 1000
    with pytest.raises(ValueError, match="does not exist"):
        a.plot(tmp_path / "nowhere" / "m.png")


def test_arrays_work_like_shapes():
    x = jnp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    a = analyze(jnp.sum, x)
    assert (a.argument_bytes, a.output_bytes, a.name) == (48, 4, "sum")
