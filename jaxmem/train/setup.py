"""`Setup`: everything one invocation of `python -m jaxmem.train` needs, built and validated by
`jaxmem.train.cli.setup` before any training work, run by `jaxmem.train.loop.train`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxmem.families.config import ModelConfig
from jaxmem.config.run import RunConfig
from jaxmem.data.examples import PackedData
from jaxmem.data.tokenizers import ByteTokenizer, HFTokenizer
from jaxmem.io.checkpoint import Checkpointer
from jaxmem.optim import LossScale
from jaxmem.train.placement import Placement
from jaxmem.train.step import StepConfig, TrainState

Tokens = np.ndarray | PackedData  # a token stream, or example rows packed (jaxmem.data.examples)


@dataclasses.dataclass
class Setup:
    """A validated run: its config and the objects built from it.

    `state` is the restored train state when the run continues from a checkpoint (else None:
    the loop initializes it, from `init_params` when --init-from gave step-0 weights). `ckpt`
    is the checkpointer that restored it. For LoRA / QLoRA, `frozen` is the frozen base on the
    device and `base_record` its source and sha256 (config.json)."""

    cfg: RunConfig
    model_cfg: ModelConfig
    step_cfg: StepConfig
    loss_scale: LossScale
    out: Path
    tokenizer: ByteTokenizer | HFTokenizer
    train_tokens: Tokens
    eval_tokens: Tokens
    stats: dict
    ckpt: Checkpointer | None = None
    state: TrainState | None = None
    continuing: bool = False
    record: dict = dataclasses.field(default_factory=dict)  # the saved config.json, continuing
    changes: list = dataclasses.field(default_factory=list)  # (field, from, to) changed now
    init_params: dict | None = None  # step-0 weights from --init-from (None: random init)
    frozen: dict | None = None  # LoRA: the frozen base on the device (jaxmem.peft.base)
    base_record: dict | None = None  # LoRA: its source and sha256, for config.json
    placement: Placement = Placement.single()
