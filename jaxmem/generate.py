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

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.config import ModelConfig
from jaxmem.model import Llama
from jaxmem.precision import cast_params


def sample_tokens(config: ModelConfig, params, prompt_ids, max_new_tokens: int,
                  temperature: float = 0.8, top_k: int = 0, seed: int = 0,
                  compute_dtype=jnp.float32) -> list[int]:
    """Prompt ids + up to `max_new_tokens` sampled ids (capped by max_position_embeddings)."""
    limit = config.max_position_embeddings
    prompt_ids = list(prompt_ids)[-max(1, limit - max_new_tokens):]
    n_prompt = len(prompt_ids)
    total = min(limit, n_prompt + max_new_tokens)
    buf = jnp.zeros((1, total), jnp.int32).at[0, :n_prompt].set(jnp.asarray(prompt_ids, jnp.int32))
    model = Llama(config)
    params = cast_params(params, compute_dtype)

    @jax.jit
    def run(params, buf, key):
        def body(pos, carry):
            buf, key = carry
            logits = model.apply({"params": params}, buf)[0, pos - 1]  # [V] fp32
            key, sub = jax.random.split(key)
            if temperature <= 0:
                nxt = jnp.argmax(logits)
            else:
                logits = logits / temperature
                if top_k:
                    kth = jax.lax.top_k(logits, top_k)[0][-1]
                    logits = jnp.where(logits < kth, -jnp.inf, logits)
                nxt = jax.random.categorical(sub, logits)
            return buf.at[0, pos].set(nxt.astype(jnp.int32)), key

        return jax.lax.fori_loop(n_prompt, total, body, (buf, key))[0]

    return [int(t) for t in np.asarray(run(params, buf, jax.random.PRNGKey(seed)))[0]]


def generate_text(config, params, tokenizer, prompt: str, max_new_tokens: int = 200,
                  temperature: float = 0.8, top_k: int = 40, seed: int = 0,
                  compute_dtype=jnp.float32) -> str:
    ids = [tokenizer.bos_id] + list(tokenizer.encode(prompt))
    out = sample_tokens(config, params, ids, max_new_tokens, temperature,
                        min(top_k, config.vocab_size), seed, compute_dtype)
    return tokenizer.decode(out)


def load_run(run_dir: Path):
    """(ModelConfig, StepConfig, TrainState, tokenizer, run config) of the newest committed step."""
    from jaxmem.checkpoint import Checkpointer
    from jaxmem.data import load_tokenizer
    from jaxmem.run import RunError, abstract_train_state, build_step_config, read_config

    config = read_config(Path(run_dir) / "config.json")
    model_cfg, step_cfg, loss_scale = build_step_config(config)
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", keep=config.get("keep", 3))
    step = ckpt.latest_step()
    if step is None:
        raise RunError(f"--run {run_dir}: no committed checkpoint in {Path(run_dir) / 'checkpoints'}")
    state, _ = ckpt.restore(step, abstract_train_state(step_cfg, loss_scale, config["seed"]))
    ckpt.close()
    return model_cfg, step_cfg, state, load_tokenizer(config.get("tokenizer")), config


def main(argv=None) -> int:
    from jaxmem.checkpoint import CheckpointError
    from jaxmem.data import DataError
    from jaxmem.run import RunError, exit_after_failed_restore

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
