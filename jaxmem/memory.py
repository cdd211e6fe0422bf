"""How much memory a configuration needs, measured by compiling it ahead of time.

    python -m jaxmem.memory --preset tiny --num-layers 16 --batch-size 8 --seq-len 256 \
        --remat full --json

compiles the gradient of the loss for that configuration on the current backend (nothing is
allocated: parameters and batch are `jax.ShapeDtypeStruct`s) and reports XLA's own numbers from
`compiled.memory_analysis()` and `compiled.cost_analysis()`:

    temp_bytes      scratch XLA allocates during the step (activations saved for backward live here)
    argument_bytes  inputs: parameters and batch
    output_bytes    outputs: loss and gradients
    alias_bytes     outputs that reuse (donated) input buffers
    peak_bytes      temp + argument + output - alias
    flops           XLA's FLOP count for the whole step (remat's recomputation shows up here)
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

from jaxmem.config import ConfigError, ModelConfig, add_model_args, model_config_from_args
from jaxmem.loss import abstract_batch, lm_loss
from jaxmem.model import Llama, abstract_params, count_params
from jaxmem.remat import VALID_POLICIES, RematError, RematPolicy


def compiled_stats(compiled) -> dict:
    """XLA's memory and cost numbers for a compiled executable, as a plain dict."""
    mem = compiled.memory_analysis()
    stats = {
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
    }
    stats["peak_bytes"] = (stats["temp_bytes"] + stats["argument_bytes"] + stats["output_bytes"]
                           - stats["alias_bytes"])
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returns one dict per computation
        cost = cost[0] if cost else {}
    return stats, float((cost or {}).get("flops", float("nan")))


def grad_step_report(config: ModelConfig, remat: RematPolicy | str, batch_size: int,
                     seq_len: int) -> dict:
    """Compile value_and_grad of the loss (fp32) ahead of time and report its memory and FLOPs."""
    remat = RematPolicy.parse(remat)
    model = Llama(config, remat)
    params = abstract_params(config)
    step = jax.jit(jax.value_and_grad(lambda p, b: lm_loss(model, p, b)))
    compiled = step.lower(params, abstract_batch(batch_size, seq_len)).compile()
    stats, flops = compiled_stats(compiled)
    return {
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "remat": str(remat),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "params": count_params(params),
        "compiled": stats,
        "flops": flops,
    }


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_report(r: dict) -> str:
    c = r["compiled"]
    rows = [("backend", f"{r['backend']} (jax {r['jax_version']})"),
            ("remat", r["remat"]),
            ("batch x seq", f"{r['batch_size']} x {r['seq_len']}"),
            ("params", f"{r['params']:,}"),
            ("temp", _mb(c["temp_bytes"])),
            ("arguments", _mb(c["argument_bytes"])),
            ("outputs", _mb(c["output_bytes"])),
            ("aliased", _mb(c["alias_bytes"])),
            ("peak", _mb(c["peak_bytes"])),
            ("flops", f"{r['flops']:.4g}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxmem.memory",
        description="Compile the gradient step of a configuration ahead of time (no allocation) "
                    "and report XLA's memory and FLOP numbers.")
    add_model_args(p)
    p.add_argument("--batch-size", type=positive_int, default=8, help="micro-batch size (default 8)")
    p.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--remat", default="none",
                   help=f"remat policy: {', '.join(VALID_POLICIES)} (default none)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = model_config_from_args(args)
        remat = RematPolicy.parse(args.remat)
        if remat.kind == "offload":
            remat.jax_policy()  # raises a clear error where the backend cannot offload
    except (ConfigError, RematError) as e:
        parser.error(str(e))
    if args.seq_len > config.max_position_embeddings:
        parser.error(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings "
                     f"{config.max_position_embeddings}")
    report = grad_step_report(config, remat, args.batch_size, args.seq_len)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
