"""`python -m jaxmem.recipes`: the shipped recipes, one line each, and one recipe's file.

    python -m jaxmem.recipes                 # name, model, method, card, tokens per step, plan
    python -m jaxmem.recipes show NAME       # the YAML file, to copy and edit (--config FILE)

The listing's peak is the planner's analytic figure (jaxmem.memory, no compile: under a
second per recipe) for the run's largest phase, per device on a recipe's mesh, against what XLA
may use of the recipe's card (or of the smaller size its name states: jaxmem.recipes.plan);
`python -m jaxmem.memory ... --target CARD --compile` compiles it for the card (docs/recipes.md
gives each recipe's compiled figure). An unknown NAME exits 2 with one line naming the nearest.
"""

from __future__ import annotations

import argparse
import sys

from jaxmem import recipes
from jaxmem.errors import ConfigError
from jaxmem.memory.spec import GiB


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxmem.recipes",
        description="The recipes jaxmem ships (python -m jaxmem.train --recipe NAME --init-from "
                    "HF_DIR --data FILES): with no command, one line each with the planner's "
                    "analytic peak against the recipe's card; `show NAME` prints a recipe's "
                    "YAML file to copy and edit.")
    sub = p.add_subparsers(dest="command", metavar="{list,show}")
    sub.add_parser("list", help="one line per recipe (the default)")
    show = sub.add_parser("show", help="print a recipe's YAML file")
    show.add_argument("name", metavar="NAME", help="a recipe's name (python -m jaxmem.recipes)")
    return p


def method(cfg) -> str:
    """A run's method in a few words: full / LoRA / QLoRA, the objective, where the state lives."""
    peft, optim = cfg.peft, cfg.optim
    if peft.lora_rank:
        quant = {"none": "LoRA", "int8": "QLoRA int8", "nf4": "QLoRA NF4"}[peft.quantize_base]
        words = [f"{quant} r{peft.lora_rank}"] + (["base on host"] if peft.offload_base == "host"
                                                  else [])
    else:
        host = "+".join(what for what, where in (("optimizer", optim.offload_optimizer),
                                                  ("weights", optim.offload_params))
                        if where == "host")
        words = [f"full {optim.optimizer}"] + (["in-backward"] if optim.in_backward else []) + (
            [f"{host} on host"] if host else [])
    if cfg.objective.objective != "causal-lm":
        words.insert(0, cfg.objective.objective.upper())
    return ", ".join(words) + f", {cfg.precision.mode}"


def line(name: str) -> str:
    """One recipe's listing line."""
    from jaxmem.recipes.plan import plan, spec_of  # noqa: PLC0415  (the planner: the listing)

    cfg, p, spec = recipes.run_config(name), plan(name), spec_of(name)
    tokens = spec.rows * spec.seq_len * spec.grad_accum  # a preference pair is two rows
    devices = f"{p.devices} x " if p.devices > 1 else ""
    where = f"{devices}{p.card}" + (f" ({p.budget_bytes / GiB:g} GiB budget)"
                                     if p.budget_bytes < _card_bytes(p.card) else "")
    verdict = "fits" if p.fits else "DOES NOT FIT"
    return (f"{name:34s} {cfg.model.preset:14s} {method(cfg):64s} {where:24s} {tokens:>9,} "
            f"{p.peak_bytes / GiB:6.2f} / {p.usable_bytes / GiB:5.2f} GiB {verdict} "
            f"({p.phase})")


def _card_bytes(card: str) -> int:
    from jaxmem import target  # noqa: PLC0415

    return target.CARDS[card].memory_bytes


def listing() -> str:
    head = (f"{'recipe':34s} {'model':14s} {'method':64s} {'card':24s} {'tokens':>9s} "
            f"peak / usable per device (analytic, jaxmem.memory; usable: XLA's share of the "
            f"card)")
    return "\n".join([head] + [line(n) for n in recipes.names()])


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.command == "show":
        try:
            path = recipes.recipe_path(args.name)
        except ConfigError as e:
            p.exit(2, f"{p.prog}: error: {e}\n")
        sys.stdout.write(path.read_text())
        return 0
    print(listing())
    return 0
