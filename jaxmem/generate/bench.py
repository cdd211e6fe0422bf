"""`python -m jaxmem.generate.bench`: decoding speed with the KV cache against the old sampler
(the whole buffer through the model for every new token), back to back, same weights and prompt.

    python -m jaxmem.generate.bench --preset small --prompt-tokens 16 --new-tokens 256

Random init, greedy, fp32 (the CPU's only fast dtype) unless --dtype. Both samplers are compiled
ahead of time and the compile is timed apart; tokens/s is new tokens over the run's wall time
(prefill included), the best of --repeats runs. The two outputs are compared token for token.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.families import PRESETS, get_preset
from jaxmem.decode.sampling import _sampler, uncached_sampler
from jaxmem.families.params import init_params
from jaxmem.model.precision import cast_params


def _timed(fn, args, repeats):
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - t0)
    return out, compile_s, best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxmem.generate.bench", description=__doc__.split(
        "\n")[0])
    p.add_argument("--preset", default="small", choices=list(PRESETS))
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-uncached", action="store_true", help="time the cached sampler only")
    args = p.parse_args(argv)
    cfg = get_preset(args.preset)
    P, total = args.prompt_tokens, args.prompt_tokens + args.new_tokens
    params = cast_params(init_params(cfg, jax.random.PRNGKey(0)), jnp.dtype(args.dtype))
    prompt = jax.random.randint(jax.random.PRNGKey(1), (1, P), 0, cfg.vocab_size, jnp.int32)
    key = jax.random.PRNGKey(0)
    result = {"preset": args.preset, "prompt_tokens": P, "new_tokens": args.new_tokens,
              "dtype": args.dtype, "backend": jax.default_backend(), "jax": jax.__version__}

    cached = _sampler(cfg, P, total, 0.0, 0, (), args.dtype)
    (new, _), c_s, r_s = _timed(cached, (params, prompt, jnp.ones((1, P), bool), key),
                                args.repeats)
    result.update(cached_compile_s=round(c_s, 2), cached_run_s=round(r_s, 3),
                  cached_tokens_per_s=round(args.new_tokens / r_s, 1))
    if not args.skip_uncached:
        buf = jnp.zeros((1, total), jnp.int32).at[:, :P].set(prompt)
        old, c_s, r_s = _timed(uncached_sampler(cfg, P, total, 0.0, 0), (params, buf, key),
                               args.repeats)
        result.update(uncached_compile_s=round(c_s, 2), uncached_run_s=round(r_s, 3),
                      uncached_tokens_per_s=round(args.new_tokens / r_s, 1))
        ratio = result["cached_tokens_per_s"] / result["uncached_tokens_per_s"]
        result["speedup"] = round(ratio, 1)
        result["same_tokens"] = int(np.sum(np.asarray(old)[0, P:] == np.asarray(new)[0]))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
