"""`python -m jaxmem.generate`: sample text from the newest checkpoint of a run.

    python -m jaxmem.generate --run runs/default --prompt "def main(" --max-new-tokens 200

Temperature 0 is greedy decoding; `--top-k K` samples among the K most likely tokens. The whole
generation is one jitted `fori_loop` over a fixed-size token buffer (no KV cache: each new token
reruns the model over the buffer, which is fine for the small models this is meant to inspect).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxmem.generate.sampling import generate_text


def main(argv=None) -> int:
    from jaxmem.io.checkpoint import CheckpointError
    from jaxmem.data import DataError
    from jaxmem.io.rundir import RunError, exit_after_failed_restore, load_run

    p = argparse.ArgumentParser(prog="python -m jaxmem.generate",
                                description="Sample from the newest checkpoint of a jaxmem run.")
    p.add_argument("--run", required=True, help="run directory (the --out of jaxmem.train)")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40, help="0: sample from all tokens")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.max_new_tokens <= 0:
        p.error(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.top_k < 0 or not args.temperature >= 0:
        p.error("--top-k and --temperature must be >= 0")
    try:
        model_cfg, step_cfg, state, tokenizer, _ = load_run(Path(args.run))
    except (RunError, CheckpointError, DataError, ValueError) as e:
        if isinstance(e, CheckpointError):
            exit_after_failed_restore(p, str(e).splitlines()[0])
        p.error(str(e).splitlines()[0])
    text = generate_text(model_cfg, state.params, tokenizer, args.prompt, args.max_new_tokens,
                         args.temperature, args.top_k, args.seed, step_cfg.precision.compute_dtype)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
