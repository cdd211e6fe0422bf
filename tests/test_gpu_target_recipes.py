"""Every shipped recipe compiled for its own card without the card (jaxmem.target): the largest
phase of its run (per device on a recipe's mesh: the step) fits what XLA may use of the card, or
of the smaller size the recipe's name states, and equals the figure its file's `# Planned:`
line gives within 5% (the line is the record of the compile; a change that moves a recipe's
peak updates it). One compile per phase, ~1 to 2 minutes per recipe on 2 cores (docs/recipes.md:
the 70B one's time)."""

from __future__ import annotations

import re

import pytest

from jaxmem import recipes
from jaxmem.recipes.plan import compile_plan

from tiers import RECIPES_IN_CI, nightly_except

pytestmark = [pytest.mark.gpu_target, pytest.mark.slow]


def planned_gib(name: str) -> float:
    """The compiled figure the recipe's file records: `# Planned: <phase> X GiB compiled ...`."""
    m = re.search(r"^# Planned: \w+ ([\d.]+) GiB compiled", recipes.recipe_path(name).read_text(),
                  re.M)
    assert m, f"{name}: no '# Planned: <phase> X GiB compiled' line"
    return float(m.group(1))


# CI compiles the recipes whose runs CI trains (tiers.RECIPES_IN_CI: the Gemma 3 one, the 70B
# FSDP one, the 8B one with everything on the host, DPO, the quick start); the other four (Qwen3
# QLoRA at three sizes, the 8B on 80 GB) are nightly, about 3 minutes of compiles on 2 cores.
@pytest.mark.parametrize("name", nightly_except(recipes.names(), RECIPES_IN_CI))
def test_recipe_fits_its_card_on_the_cards_compiler(name):
    p = compile_plan(name)
    assert p.source.startswith("compiled")
    assert p.fits, f"{name}: {p.peak_bytes / 2**30:.2f} GiB > usable {p.usable_bytes / 2**30:.2f}"
    assert p.peak_bytes / 2**30 == pytest.approx(planned_gib(name), rel=0.05)
