"""experiments/compare.py: one tiny configuration in-process on both sides, the byte counts, the
report. (The subprocess-per-configuration driver runs in `python -m experiments.compare --quick`.)
"""

import json
import sys
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `experiments` is not installed

from experiments import compare  # noqa: E402
from experiments import torch_train as tt  # noqa: E402
from jaxmem.model.llama import Llama, abstract_params  # noqa: E402
from jaxmem.train.precision import cast_params, get_precision  # noqa: E402
from jaxmem.model.remat import RematPolicy  # noqa: E402

SPEC = {"preset": "tiny", "num_layers": 1, "batch_size": 2, "seq_len": 16, "steps": 3,
        "warmup": 1, "lr": 3e-3, "lr_warmup": 0, "seed": 0, "n_batches": 2, "threads": None}


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    try:  # one torch thread, as --quick: 2 OpenMP threads on a busy 2-core box crawl
        return [compare.worker({**SPEC, "framework": fw, "mode": "fp32", "remat": "none",
                                "threads": 1}) for fw in ("jax", "torch")]
    finally:
        torch.set_num_threads(threads)


def test_same_weights_same_batches_same_losses(pair):
    j, t = pair
    assert len(j["losses"]) == len(t["losses"]) == 3 and not any(j["skipped"] + t["skipped"])
    np.testing.assert_allclose(j["losses"], t["losses"], rtol=0, atol=1e-4)
    assert j["losses"][-1] < j["losses"][0]
    for r in pair:
        assert r["saved_bytes"] > 0 and r["step_ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(2 * 16 / (r["step_ms"] / 1e3))
        assert r["peak_bytes"] is None  # CPU: no peak allocator stat on either side
    assert j["peak_est_bytes"] > j["temp_bytes"] > 0 and t["peak_est_bytes"] is None


def test_report_ratios_table_json_png(pair, tmp_path):
    rows = compare.add_ratios(pair)
    assert len(rows) == 1 and rows[0]["mode"] == "fp32" and rows[0]["remat"] == "none"
    assert rows[0]["saved_ratio"] == pair[0]["saved_bytes"] / pair[1]["saved_bytes"]
    assert rows[0]["tps_ratio_compile"] is None  # no torch.compile run in this pair
    table = compare.format_table(pair, rows, markdown=True)
    assert "| fp32 | none | jax |" in table and "saved jax/torch" in table
    json.dumps({"results": pair, "ratios": rows})  # the JSON document is plain JSON
    compare.write_chart(tmp_path / "c.png", pair)
    png = (tmp_path / "c.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    i = png.index(b"IDAT")
    n = int.from_bytes(png[i - 4:i], "big")
    w, h = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert len(zlib.decompress(png[i + 4:i + 4 + n])) == h * (1 + 3 * w)


def jax_saved(c, remat, mode, B, T):
    model = Llama(c, RematPolicy.parse(remat))
    params = jax.eval_shape(lambda p: cast_params(p, get_precision(mode).compute_dtype),
                            abstract_params(c))
    batch = compare.make_batches(c, 1, B, T, 0)[0]
    return compare.jax_saved_bytes(model, params, batch)[0]


def torch_saved(c, remat, mode, B, T):
    model = tt.build_model(c, mode)
    tt.set_remat(model, remat)
    b = {k: torch.from_numpy(v) for k, v in compare.make_batches(c, 1, B, T, 0)[0].items()}
    return tt.saved_bytes_for_backward(model, b, mode, exclude_param_copies=True)


@pytest.mark.parametrize("mode", ["fp32", "amp-bf16"])
def test_saved_bytes_count_the_same_thing(mode):
    """Both counts exclude parameters and their compute-dtype copies. With full remat each side
    keeps the block inputs plus the same head/loss residuals, so the two counts nearly agree
    (jaxmem keeps bf16 block inputs in amp-bf16, torch fp32 ones: jax may only be smaller);
    and on both sides none > selective > full."""
    c = compare.model_config({"preset": "tiny", "num_layers": 2})
    B, T = 2, 32
    j = {r: jax_saved(c, r, mode, B, T) for r in ("none", compare.SELECTIVE, "full")}
    t = {r: torch_saved(c, r, mode, B, T) for r in ("none", "selective", "full")}
    assert j["none"] > j[compare.SELECTIVE] > j["full"]
    assert t["none"] > t["selective"] > t["full"]
    assert j["full"] <= t["full"] * 1.05
    if mode == "fp32":
        assert j["full"] == pytest.approx(t["full"], rel=0.05)
    # autocast's bf16 weight copies are excluded: with them torch keeps strictly more
    if mode == "amp-bf16":
        model = tt.build_model(c, mode)
        b = {k: torch.from_numpy(v) for k, v in compare.make_batches(c, 1, B, T, 0)[0].items()}
        assert tt.saved_bytes_for_backward(model, b, mode) > t["none"]


def test_selective_checkpoint_same_gradients():
    c = compare.model_config({"preset": "tiny", "num_layers": 2})
    model = tt.build_model(c, "fp32")
    b = {k: torch.from_numpy(v).long() for k, v in compare.make_batches(c, 1, 2, 16, 0)[0].items()}

    def grads(remat):
        tt.set_remat(model, remat)
        model.zero_grad(set_to_none=True)
        tt.lm_loss(model(b["inputs"]), b["targets"], torch.ones_like(b["targets"])).backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, g in zip(grads("selective"), grads("none")):
        torch.testing.assert_close(a, g, rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown torch remat"):
        tt.set_remat(model, "dots")


def test_cli_flags():
    args = compare.parse_args(["--quick", "--modes", "fp32", "amp-bf16", "--remats", "none",
                               "selective"])
    specs = compare.specs_from_args(args)
    assert {s["remat"] for s in specs} == {"none", compare.SELECTIVE}
    assert {(s["framework"], s["mode"]) for s in specs if s["framework"] == "torch-compile"} == {
        ("torch-compile", "fp32")}
    assert all(s["seq_len"] == 64 and s["threads"] == 1 for s in specs) and len(specs) == 10
    assert compare.torch_remat(compare.SELECTIVE) == "selective"
