"""DPO, ORPO and SimPO equal TRL 1.16's own trainers (tests/trl_preference.py runs them) on one
batch of a tiny random checkpoint saved by transformers' own class with Llama 3.1 Instruct's
tokenizer layout: the loss and every reward / log-prob metric, within the suite's fp32 policy
(tests/numerics.py).

jaxmem computes on the token ids TRL fed (its chosen / rejected sequences and which tokens count),
through the run's own code: the eval function of a StepConfig with the objective (the train
step's `objective.sums` and `reference_sums`), so the reference of a LoRA run is the frozen base
with the adapters off, and a full fine-tune's the precomputed table (jaxmem.train.reference).
The tokenization itself is compared with TRL's in tests/test_preference_data.py. A negative
control (a wrong beta; the prompt's tokens counted) fails the same comparison.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numerics import assert_reordered_fp32, fp32_rtol, model_terms

pytest.importorskip("trl")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxmem.io.hf import config_from_hf, load_hf_params, read_hf_config  # noqa: E402
from jaxmem.model.precision import get_precision  # noqa: E402
from jaxmem.objective import DPO, ORPO, SimPO  # noqa: E402
from jaxmem.peft.lora import LoraSpec  # noqa: E402
from jaxmem.peft.export import adapter_config, adapter_tensors  # noqa: E402
from jaxmem.train.reference import make_logps_fn, ref_column  # noqa: E402
from jaxmem.train.run import make_eval_fn  # noqa: E402
from jaxmem.train.step import StepConfig  # noqa: E402
from tokenizer_layouts import write_layout  # noqa: E402
from trl_preference import trl_batch  # noqa: E402

ROWS = [{"prompt": "The cat sat on", "chosen": " the mat.", "rejected": " a dog."},
        {"prompt": "Two plus two is", "chosen": " four.", "rejected": " five, said the man."},
        {"prompt": "def add(a, b):", "chosen": " return a + b", "rejected": " pass"}]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The policy checkpoint and a second one (the same, perturbed) as a separate reference."""
    d = tmp_path_factory.mktemp("pref")
    write_layout("llama3.1-instruct", d / "hf", with_weights=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(d / "hf"), dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref.save_pretrained(d / "ref")
    return d


def _params(directory):
    cfg = config_from_hf(read_hf_config(str(directory)))
    return cfg, jax.tree.map(jnp.asarray, load_hf_params(str(directory), cfg, np.float32))


def _batch(out: dict) -> dict:
    """TRL's sequences as a jaxmem preference batch: row 2i chosen, 2i + 1 rejected; `mask` the
    targets TRL's log-probs cover, `real` ORPO's NLL tokens (every real target of a row)."""
    seqs, masks = [], []
    for i in range(out["n_pairs"]):
        for side in ("chosen", "rejected"):
            seqs.append(out[f"{side}_input_ids"][i])
            masks.append(out[f"{side}_logp_mask"][i])
    T = max(map(len, seqs)) - 1
    b = {k: np.zeros((len(seqs), T), np.int32) for k in ("inputs", "targets", "mask", "real")}
    for r, (s, m) in enumerate(zip(seqs, masks)):
        n = len(s) - 1
        b["inputs"][r, :n], b["targets"][r, :n] = s[:-1], s[1:]
        b["mask"][r, :n], b["real"][r, :n] = m[1:], 1
    return b


def _jaxmem(step_cfg, params, batch, frozen=None):
    """(loss, metrics) of one batch by the run's eval function and the objective's `value`."""
    with jax.default_matmul_precision("highest"):
        sums, counts = make_eval_fn(step_cfg)(params, batch, *(() if frozen is None else (frozen,)))
    loss, metrics = step_cfg.objective.value(sums, counts)
    return float(loss), {k: float(v) for k, v in metrics.items()}


def _compare(loss, metrics, out, terms, keys=METRICS, beta=0.0):
    """The policy's check on each value; a reward is a difference of log-prob sums (DPO: policy
    minus reference), so its rounding is relative to beta x the log-probs it was taken from."""
    assert_reordered_fp32(np.float32(loss), np.float32(out["loss"]), terms=terms)
    scale = beta * max(abs(out["logps/chosen"]), abs(out["logps/rejected"]))
    for k in keys:
        if k.startswith("rewards/") and beta:
            rtol = fp32_rtol(terms)
            np.testing.assert_allclose(metrics[k], out[k], rtol=rtol, atol=rtol * scale,
                                       err_msg=k)
        else:
            assert_reordered_fp32(np.float32(metrics[k]), np.float32(out[k]), terms=terms,
                                  err_msg=k)


def _lora_adapters(spec, cfg, d):
    """Random adapters with B != 0 (so the policy differs from the reference), written in
    PEFT's layout by jaxmem's own export."""
    from safetensors.numpy import save_file
    adapters = spec.init_adapters(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(3)
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray(rng.normal(0, 0.2, x.shape), jnp.float32)
        if "lora_b" in jax.tree_util.keystr(p) else x, adapters)
    d.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(jax.tree.map(np.asarray, adapters), spec, cfg),
              str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    (d / "adapter_config.json").write_text(json.dumps(adapter_config(spec, "", cfg), indent=2))
    return adapters


@pytest.mark.slow  # about 10 s
def test_lora_dpo_equals_trl_with_the_adapters_off_as_reference(ckpt, tmp_path):
    cfg, params = _params(ckpt / "hf")
    spec = LoraSpec(rank=4, alpha=8.0, targets=("q", "v", "gate"))
    adapters = _lora_adapters(spec, cfg, tmp_path / "adapter")
    out = trl_batch("dpo", ckpt / "hf", ROWS, adapter_dir=tmp_path / "adapter", beta=0.1)
    batch = _batch(out)
    T = batch["inputs"].shape[1]
    step = StepConfig(cfg, get_precision("fp32"), trainable=spec, objective=DPO(beta=0.1))
    loss, metrics = _jaxmem(step, adapters, batch, frozen=params)
    terms = model_terms(cfg, T, loss=True)
    _compare(loss, metrics, out, terms, beta=0.1)
    assert abs(metrics["rewards/chosen"]) > 1e-2  # the reference is not the policy
    # negative control: another beta moves the loss and the rewards past the tolerance
    wrong = StepConfig(cfg, get_precision("fp32"), trainable=spec, objective=DPO(beta=0.2))
    with pytest.raises(AssertionError):
        _compare(*_jaxmem(wrong, adapters, batch, frozen=params), out, terms, beta=0.1)


@pytest.mark.slow  # about 10 s
def test_full_dpo_equals_trl_with_a_precomputed_reference(ckpt):
    cfg, params = _params(ckpt / "hf")
    _, ref_params = _params(ckpt / "ref")
    out = trl_batch("dpo", ckpt / "hf", ROWS, ref_model_dir=ckpt / "ref", beta=0.1)
    batch = _batch(out)
    T = batch["inputs"].shape[1]
    step = StepConfig(cfg, get_precision("fp32"), objective=DPO(beta=0.1))
    with jax.default_matmul_precision("highest"):
        sums = np.asarray(make_logps_fn(step)(ref_params, batch))  # the reference's pass
    table = sums.reshape(-1, 2)
    batch["ref_logps"] = ref_column(table, np.arange(len(table)), T)
    loss, metrics = _jaxmem(step, params, batch)
    terms = model_terms(cfg, T, loss=True)
    _compare(loss, metrics, out, terms, beta=0.1)
    assert_reordered_fp32(table[:, 0], np.float32(out["ref_chosen_logps"]), terms=terms)
    # negative control: the prompt's tokens counted in the log-probs
    batch["mask"] = batch["real"]
    with pytest.raises(AssertionError):
        _compare(*_jaxmem(step, params, batch), out, terms, beta=0.1)


@pytest.mark.slow  # about 8 s
@pytest.mark.parametrize("kind", ["orpo", "simpo"])
def test_orpo_and_simpo_equal_trl(ckpt, kind):
    cfg, params = _params(ckpt / "hf")
    if kind == "orpo":
        out = trl_batch("orpo", ckpt / "hf", ROWS, orpo_lambda=0.1)
        objective, keys = ORPO(orpo_lambda=0.1), METRICS + ("nll_loss", "log_odds_ratio",
                                                             "log_odds_chosen")
    else:
        out = trl_batch("simpo", ckpt / "hf", ROWS, beta=2.0, gamma=0.5)
        objective, keys = SimPO(beta=2.0, gamma=0.5), METRICS
    batch = _batch(out)
    if kind == "orpo":  # TRL's NLL tokens: its own mask, checked to be every real target
        nll = np.zeros_like(batch["real"][0::2])
        for i, m in enumerate(out["nll_mask"]):
            nll[i, :len(m) - 1] = m[1:]
        np.testing.assert_array_equal(nll, batch["real"][0::2])
    T = batch["inputs"].shape[1]
    step = StepConfig(cfg, get_precision("fp32"), objective=objective)
    loss, metrics = _jaxmem(step, params, batch)
    _compare(loss, metrics, out, model_terms(cfg, T, loss=True), keys)
