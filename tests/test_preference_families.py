"""One QLoRA DPO step on a tiny checkpoint of each family a user fine-tunes most (Llama 3.1,
Qwen3, Gemma 3), saved by transformers' own class with the family's tokenizer layout, through
`python -m jaxmem.train --init-from`: the chat template renders the conversational pairs, the
adapters-off reference makes the first loss log 2 exactly, and the step trains (a finite
gradient, adapters that move)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jaxmem.train.cli import main
from jaxmem.train.rundir import load_run
from tokenizer_layouts import write_layout

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROWS = [{"prompt": [{"role": "user", "content": f"Sort {d}"}],
         "chosen": [{"role": "assistant", "content": "".join(sorted(d))}],
         "rejected": [{"role": "assistant", "content": "".join(sorted(d, reverse=True))}]}
        for d in ("372", "9150", "864", "5203", "71", "4682")]


@pytest.mark.slow  # about 10 s each
@pytest.mark.parametrize("layout", ["llama3.1-instruct", "qwen3", "gemma3-it"])
def test_one_qlora_dpo_step_per_family(tmp_path, layout):
    hf = tmp_path / "hf"
    write_layout(layout, hf, with_weights=True)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "run"
    # hidden 48, MLP 80: NF4 blocks of 16 divide every projection's input
    assert main(["--init-from", str(hf), "--objective", "dpo", "--lora-rank", "4",
                 "--quantize-base", "nf4", "--quant-block", "16", "--data", str(data),
                 "--batch-size", "2", "--seq-len", "160", "--steps", "2", "--warmup-steps", "0",
                 "--lr", "1e-2", "--sample-tokens", "0", "--no-progress", "--log-every", "1",
                 "--eval-every", "0", "--out", str(out)]) == 0
    rec = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rec[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at step 0
    assert rec[0]["rewards/margins"] == 0.0
    assert all(np.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rec)
    b = [np.asarray(x) for p, x in __import__("jax").tree_util.tree_leaves_with_path(
        load_run(out).state.params) if "lora_b" in str(p)]
    assert any(np.abs(x).max() > 0 for x in b)  # the adapters moved
