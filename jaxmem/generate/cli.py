"""`python -m jaxmem.generate`: sample text from the newest checkpoint of a run, or from a
Hugging Face Llama checkpoint directory.

    python -m jaxmem.generate --run runs/default --prompt "def main(" --max-new-tokens 200
    python -m jaxmem.generate --hf Llama-3.2-1B --prompt "The capital of France" --temperature 0
    python -m jaxmem.generate --run runs/chat --chat --prompt "What is the capital of France?"

The sampling flags are RunConfig's `sample` section (jaxmem.config.run), the same ones that set
the sample printed at the end of a training run; their defaults here are the run's own values.
Temperature 0 is greedy decoding; `--top-k K` samples among the K most likely tokens. `--chat`
renders `--prompt` as one user turn of the chat template with the generation prompt added, and
prints the reply alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from jaxmem.config.flags import add_run_flags, given_overrides
from jaxmem.data import DataError
from jaxmem.generate.sampling import generate_text
from jaxmem.io.checkpoint import CheckpointError
from jaxmem.io.rundir import RunError, exit_after_failed_restore, fail, load_run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxmem.generate",
        description="Sample from a checkpoint of a jaxmem run (default: its newest), or from a "
                    "Hugging Face Llama directory. The sampling defaults shown are jaxmem.train's; "
                    "a run's own values, as saved in its config.json, take their place.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="run directory (the --out of jaxmem.train)")
    source.add_argument("--hf", metavar="HF_DIR", help="a Hugging Face Llama checkpoint directory "
                        "(config.json, safetensors, tokenizer.json), computed in fp32")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="with --run: sample from committed checkpoint step N (default: the newest)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
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
    if args.hf is not None:
        return _generate_hf(p, args, overrides)
    try:
        run = load_run(Path(args.run), step=args.step)
        params = run.state.params
        if run.step_config.peft is not None:  # LoRA: the adapters on the run's own base
            from jaxmem.peft.export import lora_params
            params = lora_params(run)
    except CheckpointError as e:
        exit_after_failed_restore(p, str(e).splitlines()[0])
    except (RunError, DataError, ValueError) as e:
        fail(p, str(e).splitlines()[0])
    sm = dataclasses.replace(run.config.sample, **overrides)
    tokenizer = _chat(p, args, run.tokenizer, run.config.data.chat_template)
    try:
        text = generate_text(run.model_config, params, tokenizer, sm.prompt,
                             sm.max_new_tokens, sm.temperature, sm.top_k, args.seed,
                             run.step_config.precision.compute_dtype,
                             note=lambda m: print(m, file=sys.stderr))
    except ValueError as e:  # a prompt longer than the model's context
        fail(p, f"--prompt: {e}")
    print(text)
    return 0


def _generate_hf(p, args, overrides) -> int:
    """Sample from a Hugging Face directory with its own tokenizer (jaxmem.io.hf)."""
    from jaxmem.config.run import SampleSection  # noqa: PLC0415
    from jaxmem.io.hf import hf_tokenizer, load_hf  # noqa: PLC0415

    try:
        model_config, params = load_hf(args.hf)
        tokenizer = _chat(p, args, hf_tokenizer(args.hf), None)
    except (DataError, ValueError) as e:  # HFError is a ValueError
        fail(p, str(e).splitlines()[0])
    sm = dataclasses.replace(SampleSection(), **overrides)
    try:
        text = generate_text(model_config, params, tokenizer, sm.prompt, sm.max_new_tokens,
                             sm.temperature, sm.top_k, args.seed,
                             note=lambda m: print(m, file=sys.stderr))
    except ValueError as e:  # a prompt longer than the model's context
        fail(p, f"--prompt: {e}")
    print(text)
    return 0


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
