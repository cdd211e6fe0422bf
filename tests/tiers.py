"""The `nightly` tier's cases (pytest.ini markers, docs/testing.md): which parameters of a table
CI runs, the rest marked `nightly` (imported by name, like testenv.py)."""

from __future__ import annotations

import pytest

# The recipes CI trains (tests/test_recipes.py) and compiles for their cards
# (tests/test_gpu_target_recipes.py): together they set every setting a recipe file uses (QLoRA
# with dropout and accumulation, the base on the host on an fsdp=2 mesh, in-backward with the
# state and the weights on the host and --clip 0, DPO, the quick start's defaults);
# test_recipes checks that the others' settings are a subset of theirs.
RECIPES_IN_CI = ("gemma-3-12b-qlora-24gb", "llama-3.1-70b-qlora-2x24gb-fsdp",
                 "llama-3.1-8b-full-24gb-host", "qwen3-8b-dpo-qlora-24gb", "tiny-pretrain-cpu")


def nightly_except(values, in_ci) -> list:
    """`values` for pytest.mark.parametrize, each one not in `in_ci` marked `nightly`."""
    return [v if v in in_ci else pytest.param(v, marks=pytest.mark.nightly) for v in values]
