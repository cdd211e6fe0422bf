"""Pictures: `python -m jaxmem.plot` curves and experiments.compare's chart, checked from the
matplotlib objects (lines, bars, labels), not from pixels."""

import json

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from jaxmem.plot.cli import main  # noqa: E402
from jaxmem.plot.curves import plot_runs  # noqa: E402


def fake_run(path, mode, skipped_at=()):
    path.mkdir()
    recs = []
    for step in range(1, 11):
        r = {"step": step, "loss": 5.0 / step, "lr": 1e-3 * step, "grad_norm": 1.0,
             "loss_scale": 2.0**15 if mode == "amp-fp16" else 1.0, "skipped": step in skipped_at,
             "tokens_per_sec": 100.0}
        if step % 5 == 0:
            r["eval_loss"] = 6.0 / step
        recs.append(r)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (path / "config.json").write_text(json.dumps({"schema_version": 2, "config": {
        "precision": {"mode": mode}, "remat": {"policy": "none"}}}))
    return path


def test_curves_overlay_runs_with_a_legend(tmp_path):
    a = fake_run(tmp_path / "a", "fp32")
    b = fake_run(tmp_path / "b", "amp-fp16", skipped_at=(2, 3, 7))
    fig = plot_runs([a, b])
    loss, lr, scale, skip = fig.axes
    assert len(loss.get_lines()) == 4  # train + eval per run
    train_b = loss.get_lines()[2]
    np.testing.assert_allclose(train_b.get_ydata(), [5.0 / s for s in range(1, 11)])
    np.testing.assert_allclose(loss.get_lines()[3].get_xdata(), [5, 10])
    assert [t.get_text() for t in loss.get_legend().get_texts()] == [
        "a (fp32): train", "a (fp32): eval", "b (amp-fp16): train", "b (amp-fp16): eval"]
    assert len(lr.get_lines()) == len(scale.get_lines()) == len(skip.get_lines()) == 2
    assert scale.get_yscale() == "log"
    assert list(skip.get_lines()[1].get_ydata())[-1] == 3 and list(skip.get_lines()[0].get_ydata())[-1] == 0
    for ax in fig.axes:
        assert ax.get_title() and ax.get_ylabel()
    assert "nats" in loss.get_ylabel()


def test_cli_writes_png_and_refuses_a_non_run(tmp_path, capsys):
    a = fake_run(tmp_path / "a", "fp32")
    assert main([str(a), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(tmp_path), "--out", str(tmp_path / "d.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl: not found" in err
