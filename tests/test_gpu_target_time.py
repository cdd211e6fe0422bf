"""The planner's predicted time, on the H100's own compiled step (jaxmem.memory.seconds,
jaxmem.xla.timing), without a GPU: the prediction is read from the real program, so its FLOPs
agree with the model's and its kernels are the card's (cuDNN attention, GEMM fusions).

Marked `gpu_target` (the gpu-plan extra; .ci/run installs it)."""

from __future__ import annotations

import functools

import pytest

from jaxmem import target
from jaxmem.config.run import RunConfig
from jaxmem.memory.compiled import compile_step
from jaxmem.memory.report import step_report
from jaxmem.memory.spec import StepSpec
from jaxmem.families.params import num_params
from jaxmem.perf import flops_per_token

pytestmark = pytest.mark.gpu_target


def spec(remat: str, batch: int = 2, **overrides) -> StepSpec:
    cfg = RunConfig().replace({
        "model.preset": "small", "model.num_layers": 2, "precision.mode": "amp-bf16",
        "remat.policy": remat, "data.batch_size": batch, "data.seq_len": 512, **overrides})
    return StepSpec.from_run_config(cfg)


def predicted(s: StepSpec, card: str = "h100") -> dict:
    return _predicted_for(s, card)


@functools.lru_cache(maxsize=None)  # the same spec and card compile the same program: once
def _predicted_for(s: StepSpec, card: str) -> dict:
    with target.compiling_for(card):
        return step_report(s, compile_step(s))["time"]


def test_the_kernels_run_the_models_flops():
    """The GEMMs and attention the compiled step runs add up to the model's training FLOPs
    (6 N + 12 L N H T per token, jaxmem.perf), with causal attention's half of the attention
    term (the formula, PaLM's, counts every key; the flash kernel skips the masked half): at
    least those, and under remat full the forward once more, at most 4/3 of them plus the
    loss's own work."""
    for remat, low, high in (("none", 0.99, 1.1), ("full", 1.25, 1.4)):
        t = predicted(spec(remat))
        c = spec(remat).model
        attention = 12 * c.num_layers * c.num_heads * c.resolved_head_dim * 512
        model = (flops_per_token(c, 512, num_params(c)) - attention / 2) * t["tokens"]
        assert low <= t["kernel_flops"] / model <= high, (remat, t["kernel_flops"] / model)
        assert t["busy_seconds"]["gemm"] > 0 and t["busy_seconds"]["attention"] > 0
        assert t["tokens_per_s"] == pytest.approx(t["tokens"] / t["seconds"])


def test_more_tokens_take_longer_and_fill_the_card_better():
    small, large = predicted(spec("full", 1)), predicted(spec("full", 8))
    assert large["seconds"] > small["seconds"]
    assert large["tokens_per_s"] > small["tokens_per_s"]


def test_a_faster_card_predicts_a_shorter_step():
    """The same program on the H100 (3.35 TB/s) and the A100 (312 TFLOP/s, 2.04 TB/s): each
    card's own compile and facts."""
    h100, a100 = predicted(spec("full", 4)), predicted(spec("full", 4), "a100")
    assert a100["seconds"] > 1.3 * h100["seconds"]
    assert a100["busy_seconds"]["gemm"] > 2 * h100["busy_seconds"]["gemm"]
    assert a100["machine"]["flops"] == 312e12


def test_the_planner_prints_and_writes_the_time(capsys):
    import json

    from jaxmem.memory.cli import main
    flags = ["--preset", "small", "--num-layers", "2", "--batch-size", "2", "--seq-len", "512",
             "--precision", "amp-bf16", "--remat", "full", "--target", "h100"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "predicted time (the h100's compiled step" in out and "tokens/s" in out
    assert "MFU" in out and "costliest kernels" in out and "flops nan" not in out
    assert main(flags + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["time"]["card"] == "h100" and r["time"]["seconds"] > 0
    assert 0 < r["time"]["mfu"] < 1 and len(r["time"]["costliest"]) == 10


def test_the_trainer_prints_the_runs_predicted_time():
    """jaxmem.train's banner line on a known card: the step's and the whole run's predicted
    time from its own compiled step (here the H100's, as a run there would compile it)."""
    from types import SimpleNamespace

    import jax

    from jaxmem.memory.counted import abstract_state, abstract_step_batch
    from jaxmem.train.loop import _predicted
    from jaxmem.train.step import jit_train_step
    s = spec("full", 4)
    run = SimpleNamespace(cfg=SimpleNamespace(data=SimpleNamespace(
        batch_size=4, seq_len=512, grad_accum=1)), model_cfg=s.model, step_cfg=s.step)
    with target.compiling_for("h100"):
        compiled = jit_train_step(s.step).lower(abstract_state(s), abstract_step_batch(s)).compile()
        line = _predicted(run, compiled, 1000)
        t = predicted(s)
    assert line.startswith("predicted on the h100") and "1,000 steps ~ " in line
    assert f"{t['tokens_per_s']:,.0f} tokens/s" in line
    assert jax.default_backend() == "cpu" and _predicted(run, compiled, 10) is None
