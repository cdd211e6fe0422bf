"""The device's memory phase by phase for one `python -m jaxmem.train` configuration, on a GPU:
after the fresh state, after each of a few steps, after the evaluation forward. Each line gives
the device's peak so far and what it holds then (`memory_stats`: a process's peak never goes
down, so each phase's own peak is the first line where it rises), and the step's seconds.

    PYTHONPATH=. python -m experiments.offload_peak [--steps 3] [--one-program | --programs] \
        -- TRAIN FLAGS

`--one-program` makes the fresh state as one jit, as jaxmem did before it made an offloaded state
by several programs (`jaxmem.train.host_state.create_on_host`). `--programs` prints each of those
programs as it runs: XLA's compiled temp / output / host output, and the device's peak and bytes
in use after it (it found that on jax 0.11 each 8B layer stack's program held 10.50 GiB).
Nothing is saved: the run directory is a temporary one. For the figures jaxmem.train prints for
the whole run (tok/s over --steps, the peak including the save), see experiments.gpu_check's
8b-*-host rows.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.offload_peak",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--steps", type=int, default=3, help="train steps to time (default 3)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--one-program", action="store_true",
                     help="make the fresh state as one jit, as before create_on_host")
    how.add_argument("--programs", action="store_true",
                     help="print each state-creation program's compiled memory and the "
                          "peak after it")
    p.add_argument("train", nargs=argparse.REMAINDER, help="-- then jaxmem.train's flags")
    args = p.parse_args(argv)
    flags = [f for f in args.train if f != "--"]

    import jax
    from jaxmem.train import placement
    from jaxmem.train.cli import build_parser, setup
    from jaxmem.train.loop import _Run
    from experiments.offload_peak.programs import device_line

    if args.one_program:  # what Placement.init_state calls, replaced by the old one program
        def one_program(fn, shardings, args=(), progress=False, pieces=True):
            return jax.jit(fn, out_shardings=shardings,
                           donate_argnums=tuple(range(len(args))))(*args)
        placement.create_on_host = one_program
    elif args.programs:
        from experiments.offload_peak.programs import create_printing
        placement.create_on_host = create_printing

    def say(what, t=None):
        print(f"{what:<12} {device_line()}" + (f"  {t:7.2f} s" if t is not None else ""),
              flush=True)

    with tempfile.TemporaryDirectory() as out:
        parser = build_parser()
        s = setup(parser.parse_args([*flags, "--out", out, "--no-progress", "--no-tensorboard",
                                     "--steps", str(args.steps + 1)]), parser)
        par = s.placement or placement.Placement.single()
        t = time.perf_counter()
        run = _Run(s, par)
        jax.block_until_ready(run.state)
        say("state", time.perf_counter() - t)
        for i in range(args.steps):
            t = time.perf_counter()
            run.state, m = run.train_step(run.state, run.batches.at(run.position + i), *run.frozen)
            jax.block_until_ready(m)
            say(f"step {i + 1}", time.perf_counter() - t)
        t = time.perf_counter()
        run.evaluate()
        say("eval", time.perf_counter() - t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
