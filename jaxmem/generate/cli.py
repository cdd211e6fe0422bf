"""`python -m jaxmem.generate`: sample text from the newest checkpoint of a run, or from a
Hugging Face checkpoint directory of any registered family (jaxmem.families), with a KV cache
(jaxmem.decode.sampling).

    python -m jaxmem.generate --run runs/default --prompt "def main(" --max-new-tokens 200
    python -m jaxmem.generate --hf Llama-3.2-1B --prompt "The capital of France" --temperature 0
    python -m jaxmem.generate --run runs/lora --prompts-file prompts.jsonl --output out.jsonl
    python -m jaxmem.generate --run runs/chat --chat --prompt "What is the capital of France?"

The sampling flags are RunConfig's `sample` section (jaxmem.config.sample), the same ones that set
the sample printed at the end of a training run; their defaults here are the run's own values.
Temperature 0 is greedy decoding; `--top-k K` samples among the K most likely tokens. Generation
ends at the tokenizer's EOS ids (and the checkpoint's generation_config.json's), before `--stop`.
`--prompts-file` reads one JSON object with a "prompt" string per line and writes one line per
prompt, in order: {"prompt", "completion", "new_tokens", "stop": "eos" | "stop" | "length"}.
The params (for a LoRA run: the quantized base with the adapters) are built once per call.
The tokens/s line goes to stderr. `--chat` renders each prompt as one user turn of the chat
template with the generation prompt added, and prints the reply alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from jaxmem import families
from jaxmem.config.flags import add_run_flags, given_overrides, positive_int
from jaxmem.data import DataError
from jaxmem.decode.sampling import complete_text, generate_ids, new_token_budget
from jaxmem.decode.stopping import eos_ids, sample_dtype
from jaxmem.io.checkpoint import CheckpointError
from jaxmem.train.rundir import RunError, exit_after_failed_restore, fail, load_run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxmem.generate",
        description="Sample from a checkpoint of a jaxmem run (default: its newest), or from a "
                    "Hugging Face checkpoint directory. The sampling defaults shown are "
                    "jaxmem.train's; "
                    "a run's own values, as saved in its config.json, take their place.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="run directory (the --out of jaxmem.train)")
    source.add_argument("--hf", metavar="HF_DIR",
                        help="a Hugging Face checkpoint directory (config.json, safetensors, "
                        f"tokenizer.json) of a model jaxmem reads: {families.architectures()}")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="with --run: sample from committed checkpoint step N (default: the newest)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--prompts-file", metavar="FILE.jsonl", default=None,
                   help="generate for every prompt of a JSONL file ({\"prompt\": ...} per line), "
                        "in batches, and write JSONL (instead of --prompt)")
    p.add_argument("--output", metavar="FILE", default=None,
                   help="with --prompts-file: write the JSONL here (default: stdout)")
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="N",
                   help="with --prompts-file: prompts per batch (default: 8)")
    p.add_argument("--chat", action="store_true",
                   help="apply the chat template to --prompt: one user turn, with the generation "
                        "prompt added (the run's or the checkpoint's template; jaxmem.data.chat)")
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="with --chat: this Jinja chat template instead of the run's / checkpoint's")
    add_run_flags(p, ["sample"])
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    overrides = {k.split(".")[1]: v for k, v in given_overrides(args).items()}
    if overrides.get("max_new_tokens", 1) <= 0:
        p.error(f"--max-new-tokens must be positive, got {overrides['max_new_tokens']}")
    if args.prompts_file is None and args.output is not None:
        fail(p, "--output needs --prompts-file (a single --prompt is printed)")
    if args.prompts_file is not None and "prompt" in overrides:
        fail(p, "give --prompt or --prompts-file, not both")
    prompts = read_prompts(p, args.prompts_file) if args.prompts_file else None
    load = _from_hf if args.hf is not None else _from_run
    model_config, params, tokenizer, eos, sm, run_dtype = load(p, args, overrides)
    dtype = sample_dtype(sm.dtype, run_dtype)
    if prompts is None:
        prompts = [(None, sm.prompt or "")]
    rows, stats = _generate(p, model_config, params, tokenizer, prompts, sm, args, eos, dtype)
    _write(p, args, rows)
    n = sum(r["new_tokens"] for r in rows)
    print(f"generated {n} tokens for {len(rows)} prompt(s) in {stats['run_s']:.2f} s: "
          f"{n / max(stats['run_s'], 1e-9):,.1f} tokens/s ({dtype.name}, KV cache; compile "
          f"{stats['compile_s']:.1f} s)", file=sys.stderr)
    return 0


def _from_hf(p, args, overrides):
    """(model config, params, tokenizer, EOS ids, sample settings, run dtype) of `--hf DIR`."""
    from jaxmem.config.run import SampleSection  # noqa: PLC0415
    from jaxmem.io.hf import hf_tokenizer, load_hf  # noqa: PLC0415

    try:
        model_config, params = load_hf(args.hf, note=lambda m: print(m, file=sys.stderr))
        tokenizer = _chat(p, args, hf_tokenizer(args.hf), None)
        eos = eos_ids(tokenizer)
    except (DataError, ValueError) as e:  # HFError is a ValueError
        fail(p, str(e).splitlines()[0])
    return (model_config, params, tokenizer, eos,
            dataclasses.replace(SampleSection(), **overrides), "float32")


def _from_run(p, args, overrides):
    """The same of a run directory's checkpoint (`--run DIR [--step N]`)."""
    try:
        run = load_run(Path(args.run), step=args.step)
        # LoRA: the adapters on the run's own base, built (quantized) once per call
        params = run.step_config.trainable.run_params(run)
        eos = eos_ids(run.tokenizer)
    except CheckpointError as e:
        exit_after_failed_restore(p, str(e).splitlines()[0])
    except (RunError, DataError, ValueError) as e:
        fail(p, str(e).splitlines()[0])
    tokenizer = _chat(p, args, run.tokenizer, run.config.data.chat_template)
    return (run.model_config, params, tokenizer, eos,
            dataclasses.replace(run.config.sample, **overrides),
            run.step_config.precision.compute_dtype)


def _write(p, args, rows) -> None:
    """One --prompt's text (its completion with --chat) on stdout, or with --prompts-file a
    JSON line per prompt, on stdout or into --output."""
    if args.prompts_file is None:
        print(rows[0]["completion" if args.chat else "text"])
        return
    lines = "".join(json.dumps({k: r[k] for k in ("prompt", "completion", "new_tokens",
                                                   "stop")}, ensure_ascii=False) + "\n"
                    for r in rows)
    if args.output is None:
        sys.stdout.write(lines)
        return
    try:
        Path(args.output).write_text(lines)
    except OSError as e:
        fail(p, f"--output {args.output}: {e.strerror or e}")


def read_prompts(p, path) -> list[tuple[int, str]]:
    """(line number, prompt) of every non-blank line; bad lines exit 2 naming file and line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        fail(p, f"--prompts-file {path}: {getattr(e, 'strerror', None) or e}")
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            fail(p, f"{path}:{n}: not JSON ({e.msg})")
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            found = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            fail(p, f"{path}:{n}: expected an object with a \"prompt\" string, found {found}")
        out.append((n, row["prompt"]))
    if not out:
        fail(p, f"{path}: no prompts")
    return out


def _generate(p, config, params, tokenizer, prompts, sm, args, eos, dtype):
    """Rows of {prompt, text, completion, new_tokens, stop} in input order, and timing stats.
    Prompts of similar length share a batch (less left padding)."""
    encoded = [(n, text, tokenizer.encode_prompt(text)) for n, text in prompts]
    limit = config.max_position_embeddings
    for n, _, ids in encoded:
        try:
            budget = new_token_budget(len(ids), sm.max_new_tokens, limit)
        except ValueError as e:  # a prompt longer than the model's context
            fail(p, f"{args.prompts_file}:{n}: {e}" if n else f"--prompt: {e}")
        if budget < sm.max_new_tokens and n is None:
            print(f"note: output shortened to {budget} new tokens (asked {sm.max_new_tokens}): "
                  f"the prompt's {len(ids)} tokens + the new ones fill the model's {limit} "
                  f"positions", file=sys.stderr)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][2]))
    rows, stats = [None] * len(encoded), {}
    for b in range(0, len(order), args.batch_size):
        idx = order[b:b + args.batch_size]
        new = generate_ids(config, params, [encoded[i][2] for i in idx], sm.max_new_tokens,
                           sm.temperature, min(sm.top_k, config.vocab_size), args.seed, dtype,
                           eos, stats=stats)
        for i, ids in zip(idx, new):
            text, tail, stopped = complete_text(tokenizer, encoded[i][2], ids,
                                                (sm.stop,) if sm.stop else ())
            why = "stop" if stopped else ("eos" if ids and ids[-1] in eos else "length")
            rows[i] = dict(prompt=encoded[i][1], text=text, completion=tail,
                           new_tokens=len(ids), stop=why)
    return rows, stats

def _chat(p, args, tokenizer, template_file):
    """--chat: the tokenizer whose prompt is the chat template's user turn (else `tokenizer`)."""
    if not args.chat:
        return tokenizer
    from jaxmem.data.chat import (HOW_TO_GIVE_ONE, ChatPromptTokenizer,  # noqa: PLC0415
                                  find_chat_template, with_tokenizer_specials)

    try:
        template = find_chat_template(getattr(tokenizer, "path", None),
                                      args.chat_template or template_file)
    except DataError as e:
        fail(p, f"--chat: {e}")
    if template is None:
        fail(p, f"--chat: no chat template for {getattr(tokenizer, 'path', 'the byte tokenizer')}; "
                f"{HOW_TO_GIVE_ONE}")
    return ChatPromptTokenizer(tokenizer, with_tokenizer_specials(template, tokenizer))

