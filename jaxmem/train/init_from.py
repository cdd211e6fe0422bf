"""`--init-from HF_DIR`: a run that starts from a Hugging Face checkpoint's weights (any family
jaxmem.families registers).

The checkpoint fixes the model: its config.json's fields become the run's `model` section (every
field, so config.json of the run is complete without the checkpoint) and its tokenizer.json the
run's `--tokenizer`; the weights replace the random init at step 0 only. A continued run restores
its own checkpoints and never reads the weights again; like any `--tokenizer` run it reads the
tokenizer.json its config names (the checkpoint's, by absolute path).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

from jaxmem.families.config import ModelConfig
from jaxmem.io.hf import TOKENIZER, HFError, config_from_hf, load_hf_params, read_hf_config


def init_from_overrides(overrides: dict) -> dict:
    """`overrides` ({'section.field': value}) plus the checkpoint's model fields and tokenizer
    when 'init.init_from' is given. HFError (one line) when the directory or a flag conflicts."""
    hf_dir = overrides.get("init.init_from")
    if hf_dir is None:
        return overrides
    hf_dir = str(Path(hf_dir).resolve())
    model = config_from_hf(read_hf_config(hf_dir), note=lambda m: print(m, file=sys.stderr))
    given = sorted(p for p in overrides if p.startswith("model.") or p == "data.tokenizer")
    if given:
        flag = "--" + given[0].split(".")[1].replace("_", "-")
        raise HFError(f"{flag} cannot be given with --init-from: the checkpoint {hf_dir} sets the "
                      f"model's shape and tokenizer")
    tokenizer = Path(hf_dir) / TOKENIZER
    if not tokenizer.is_file():
        raise HFError(f"--init-from {hf_dir}: no {TOKENIZER} (the run trains with the "
                      f"checkpoint's tokenizer)")
    fields = {f"model.{f.name}": getattr(model, f.name) for f in dataclasses.fields(ModelConfig)}
    return {**overrides, **fields, "init.init_from": hf_dir, "data.tokenizer": str(tokenizer)}


def init_params_from(hf_dir: str, model: ModelConfig, dtype=np.float32) -> dict:
    """The checkpoint's weights as numpy params of `model` in `dtype` (the mode's storage dtype:
    a bf16 run of an 8B model never holds an fp32 copy on the host, converted tensor by tensor).
    The train state takes them as they are: put on the device(s) leaf by leaf in that dtype and
    donated to the jitted state creation (jaxmem.train.step.create_train_state,
    Placement.init_state), so the device never holds another copy either. HFError names a
    missing shard or tensor, or a wrong shape."""
    hf = config_from_hf(read_hf_config(hf_dir))
    if hf != model:
        raise HFError(f"--init-from {hf_dir}: its config.json no longer matches the run's model")
    return load_hf_params(hf_dir, model, np.dtype(dtype))
