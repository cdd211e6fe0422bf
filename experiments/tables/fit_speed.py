"""How many compiles and how long `--fit` takes: compile every candidate in order (the planner
before analytic-first) against analytic-first, on the same machine in one sitting.

    python -m experiments.tables.fit_speed --preset tiny --seq-len 512 --global-batch 8 --fit 0.1

Prints one line per mode (compiles, candidates tried, seconds, the choice and its compiled peak)
and writes experiments/results/fit_speed_<date>.json. The compile cache is switched off (each
compile is a real one in both modes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import jax

from experiments.common.resultfiles import new_result_file


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.tables.fit_speed",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--fit", type=float, required=True, help="budget in GiB")
    p.add_argument("--reverse", action="store_true",
                   help="time analytic-first first (so warm-up cannot favour it)")
    args = p.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    from jaxmem.config.run import RunConfig
    from jaxmem.memory.analytic import analytic_breakdown
    from jaxmem.memory.search import candidates, plan
    from jaxmem.memory.spec import GiB, StepSpec
    cfg = RunConfig().replace({"model.preset": args.preset, "precision.mode": args.precision,
                               "optim.optimizer": args.optimizer, "data.seq_len": args.seq_len,
                               "data.batch_size": args.global_batch})
    base = StepSpec.from_run_config(cfg)
    rows = []
    for analytic_first in ((True, False) if args.reverse else (False, True)):
        t0 = time.perf_counter()
        r = plan(base, args.global_batch, int(args.fit * GiB), analytic_first=analytic_first)
        secs = time.perf_counter() - t0
        specs = {(s.batch_size, str(s.remat), s.mu_dtype): s
                 for s in candidates(base, args.global_batch)}
        for t in r["tried"]:  # the analytic peak of every candidate, after the timing
            if t.get("analytic_bytes") is None:
                key = (t["batch_size"], t["remat"], t["mu_dtype"])
                t["analytic_bytes"] = analytic_breakdown(specs[key])["total_bytes"]
        s = r["spec"]
        rows.append({"analytic_first": analytic_first, "compiles": r["compiles"],
                     "tried": len(r["tried"]), "seconds": round(secs, 1),
                     "chosen": None if s is None else
                     f"micro {s.batch_size} x accum {s.grad_accum}, remat {s.remat}, mu {s.mu_dtype}",
                     "chosen_peak_gib": None if s is None else r["chosen"]["peak_bytes"] / GiB,
                     "candidates": [{k: t.get(k) for k in ("batch_size", "remat", "mu_dtype",
                                                           "decided_by", "analytic_bytes",
                                                           "peak_bytes", "fits")}
                                    for t in r["tried"]]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "candidates"}), flush=True)
    report = {"date": datetime.date.today().isoformat(), "backend": jax.default_backend(),
              "jax": jax.__version__, "args": vars(args), "rows": rows}
    out = new_result_file("fit_speed_reverse" if args.reverse else "fit_speed")
    out.write_text(json.dumps(report, indent=2))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
