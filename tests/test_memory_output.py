"""What `python -m jaxmem.memory` tells a user: header, verdict, the --fit command, the plot."""

import json
import shlex
import subprocess
import sys

import pytest

from jaxmem.config.flags import given_overrides
from jaxmem.memory.cli import build_parser, main
from jaxmem.memory.report import train_command
from jaxmem.xla.verdict import GiB, usable_gib, verdict_lines

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--intermediate-size", "128",
         "--seq-len", "32"]


def test_verdict_names_sizes_and_headroom(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    assert usable_gib(40) == 30.0 and usable_gib(24) == 18.0
    lines = verdict_lines(int(24.46 * GiB), "compiled", "cpu", "amp-bf16")
    assert lines[0] == ("verdict: compiled peak 24.46 GiB fits on 40 GiB, 80 GiB, 141 GiB; "
                        "does not fit on 12 GiB, 16 GiB, 24 GiB")
    text = "\n".join(lines)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in text and "75%" in text
    assert "not a GPU's program" in text and "--target h100" in text  # a CPU compile says so
    assert "XLA:CPU" not in "\n".join(verdict_lines(GiB, "compiled", "gpu", "amp-bf16"))
    assert "fits on every" in verdict_lines(GiB, "measured", "gpu", "fp32")[0]
    assert "does not fit on any" in verdict_lines(200 * GiB, "compiled", "cpu", "fp32")[0]
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".95")
    # 24.46 GiB fits in 95% of 24 GiB? no (22.8); 30 GiB fits in 40 * .95 = 38
    assert verdict_lines(int(30 * GiB), "compiled", "gpu", "fp32")[0].endswith(
        "fits on 40 GiB, 80 GiB, 141 GiB; does not fit on 12 GiB, 16 GiB, 24 GiB")
    assert usable_gib(24) == pytest.approx(22.8)


@pytest.mark.slow  # 6.6 s cold on 2 cores (default run kept under 5 min)
def test_breakdown_prints_header_and_verdict(capsys):
    # --compile: every phase compiled, so the verdict is a compiled one whichever is largest
    assert main([*SMALL, "--precision", "amp-bf16", "--remat", "full", "--batch-size", "2",
                 "--compile"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("jaxmem.memory: tiny (") and out[0].endswith(
        " params), precision amp-bf16, remat full")
    assert out[1] == "  optimizer adamw (mu param dtype), batch 2 x 32 tokens, grad accum 1 (global batch 2)"
    (verdict,) = [l for l in out if l.startswith("verdict: compiled peak ")]
    assert verdict.endswith("fits on every common GPU size (12 GiB, 16 GiB, 24 GiB, 40 GiB, "
                            "80 GiB, 141 GiB)")
    assert max(map(len, out)) <= 120


@pytest.mark.slow  # compiles the four phases
def test_breakdown_prints_the_phases_and_the_largest_decides(capsys):
    """The run's phases after the step; --compile compiles all of them; the verdict is on the
    largest; no sample phase with --max-new-tokens 0."""
    assert main([*SMALL, "--batch-size", "2", "--compile", "--max-new-tokens", "8",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    ph = r["phases"]
    rows = {p["name"]: p for p in ph["phases"]}
    assert list(rows) == ["state", "step", "eval", "sample"]
    assert all(p["compiled_bytes"] > 0 for p in rows.values())
    assert rows["step"]["compiled_bytes"] == r["compiled"]["peak_bytes"]
    largest = max(rows.values(), key=lambda p: p["compiled_bytes"])
    assert (ph["peak_phase"], ph["peak_bytes"]) == (largest["name"], largest["compiled_bytes"])
    assert r["verdict"][0].startswith(f"verdict: compiled peak {ph['peak_bytes'] / GiB:.2f} GiB")
    assert r["verdict"][-1].startswith(f"  the run's largest phase: {ph['peak_phase']} (GiB:")
    assert main([*SMALL, "--batch-size", "2", "--max-new-tokens", "0"]) == 0
    out = capsys.readouterr().out
    assert "phases of the run" in out and "\n  sample " not in out and "\n* sample" not in out
    assert "\n  state " in out or "\n* state " in out


@pytest.mark.slow  # the planner compiles its candidates
def test_fit_prints_candidates_once_and_the_train_command(capsys):
    # no end-of-run sample: at this toy size its phase (1 x 264 tokens) would be the largest
    # a GPU of 0.504 GiB: 4 MiB usable beside the CUDA context (verdict.usable_bytes)
    args = [*SMALL, "--fit", "0.504", "--global-batch", "4", "--max-new-tokens", "0"]
    code = main(args)
    cap = capsys.readouterr()
    assert "tried micro" not in cap.err and "micro" not in cap.err  # the list goes to stdout once
    cands = [l for l in cap.out.splitlines() if l.startswith(("  no ", "  FITS ", "  CHOSE "))]
    assert len(cands) == len({l for l in cands}) >= 1
    if code == 1:
        pytest.skip("nothing fit this budget on this machine")
    (cmd_line,) = [l.strip() for l in cap.out.splitlines() if l.strip().startswith("python -m jaxmem.train")]
    (chosen,) = [l.split() for l in cands if l.startswith("  CHOSE ")]  # the one marked
    # the printed command parses back into the chosen configuration
    from jaxmem.train.cli import build_parser as train_parser
    from jaxmem.config.run import RunConfig
    cfg = RunConfig().replace(given_overrides(train_parser().parse_args(shlex.split(cmd_line)[3:])))
    assert (cfg.data.batch_size, cfg.data.grad_accum) == (int(chosen[2]), int(chosen[5]))
    assert (cfg.remat.policy, cfg.optim.mu_dtype) == (chosen[7], chosen[9])
    cfg = given_overrides(train_parser().parse_args(shlex.split(cmd_line)[3:]))
    assert cfg["model.num_layers"] == 2 and cfg["data.seq_len"] == 32


def test_train_command_has_only_changed_fields():
    from jaxmem.config.run import RunConfig
    cmd = train_command(RunConfig().replace({"precision.mode": "amp-bf16", "data.batch_size": 4,
                                             "run.out": "x", "run.no_progress": True}))
    assert cmd == "python -m jaxmem.train --precision amp-bf16 --batch-size 4"


@pytest.mark.slow  # 7.7 s cold on 2 cores (default run kept under 5 min)
def test_plot_has_one_stacked_bar_per_configuration(tmp_path):
    pytest.importorskip("matplotlib")
    from jaxmem.memory.report import step_report
    from jaxmem.memory.spec import StepSpec
    from jaxmem.plot.memory import CATEGORIES, categories, plot_memory
    from jaxmem.config.run import RunConfig

    cfg = RunConfig().replace(given_overrides(build_parser().parse_args(SMALL)))
    reports = [step_report(StepSpec.from_run_config(cfg.replace({"remat.policy": r})))
               for r in ("none", "full")]
    for r in reports:  # the categories partition the analytic peak-phase total
        assert sum(categories(r).values()) == r["analytic"]["total_bytes"]
    fig = plot_memory(reports, ["none", "full"], budget_gib=0.05)
    (ax,) = fig.axes
    bars = [p for p in ax.patches]
    assert len(bars) == len(CATEGORIES) * 2
    heights = [sum(b.get_height() for b in bars[i::2]) for i in range(2)]  # MiB
    for h, r in zip(heights, reports):
        assert h == pytest.approx(r["analytic"]["total_bytes"] / 2**20, rel=1e-9)
    assert ax.get_ylabel() == "memory at the peak (MiB)" and ax.get_title()
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:2] == ["compiled peak (XLA)", "budget 0.05 GiB"] and labels[2:] == list(CATEGORIES)
    main([*SMALL, "--plot", str(tmp_path / "m.png")])
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
