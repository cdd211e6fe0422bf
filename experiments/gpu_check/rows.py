"""The rows of experiments.gpu_check: what each one runs (full size on a GPU, tiny with `--smoke`)
and how its numbers are read back from what the run wrote.

Every row is one or more subprocesses of programs a user runs (`python -m jaxmem.train`,
`python -m jaxmem.memory`, `python -m experiments.compare`, pytest); nothing here imports jax, so
the driver never touches the GPU (a process's peak never goes down, and jax preallocates 75% of
the device in the first process that uses it).

The random Hugging Face checkpoint of the LoRA rows is made on the spot by `make_hf` (in its own
process, JAX_PLATFORMS=cpu): the model's shapes, weights drawn from a 4M-sample normal pool at
std 0.02 (norms 1), bf16 safetensors written by jaxmem.io.hf_export.save_hf (numpy), and a
byte-level BPE tokenizer (300 tokens, the `tokenizers` package) trained on a Python source file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30

# Shapes of the random HF checkpoint: the 1B preset's (full) or a tiny one (smoke); both have more
# embedding rows than the 300-token tokenizer, as a real checkpoint may.
HF_SHAPES = {"full": {"preset": "llama-3.2-1b"},
             "smoke": {"preset": "tiny", "vocab_size": 512, "hidden_size": 64,
                       "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
                       "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 256}}


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table."""

    name: str
    kind: str  # "pytest" (the gpu tests), "train", "compare", "diag" (fp8) or "suite"
    what: str  # a few words for --help and the table
    # train: the flags jaxmem.train and jaxmem.memory share (model, precision, remat, batch,
    # optimizer, LoRA); `model` is the model's shape for jaxmem.memory when the run trains on the
    # HF checkpoint (`hf`), whose config.json jaxmem.train reads instead
    shape: tuple[str, ...] = ()
    model: tuple[str, ...] = ()
    hf: bool = False
    args: tuple[str, ...] = ()  # compare: its flags
    train: tuple[str, ...] = ()  # train: flags jaxmem.train takes and jaxmem.memory has no flag for
    timeout: float = 300.0
    needs: tuple[str, ...] = ()  # importable modules the row needs (skipped without them)


def _flags(d: dict) -> tuple[str, ...]:
    return tuple(x for k, v in d.items() for x in (f"--{k.replace('_', '-')}", str(v)))


def rows(smoke: bool) -> list[Row]:
    """Every row, in the order they run (most wanted first: a --budget skips from the end)."""
    hf_model = HF_SHAPES["smoke" if smoke else "full"]
    if smoke:  # the same programs and flags at tiny sizes, CPU in a minute
        b1, b8 = ("--preset", "tiny", "--batch-size", "2", "--seq-len", "32"), ("--preset", "tiny")
        seq8, lora_seq = ("--seq-len", "32"), ("--batch-size", "2", "--seq-len", "32")
        cmp = ("--preset", "tiny", "--num-layers", "1", "--batch-size", "2", "--seq-len", "32",
               "--steps", "2", "--warmup", "1", "--frameworks", "jax", "torch", "--threads", "1")
    else:
        b1 = ("--preset", "llama-3.2-1b", "--batch-size", "8", "--seq-len", "2048")
        b8, seq8 = ("--preset", "llama-3-8b"), ("--seq-len", "2048")
        lora_seq = ("--batch-size", "1", "--seq-len", "2048")
        cmp = ("--preset", "llama-3.2-1b", "--seq-len", "2048", "--batch-size", "4",
               "--steps", "10")
    amp = ("--precision", "amp-bf16", "--remat", "full")
    sr8 = ("--precision", "bf16-sr", "--optimizer", "adamw8bit", "--remat", "full")
    lora = ("--lora-rank", "16", "--lora-alpha", "32", *amp, *lora_seq)
    hf_flags = _flags({k: v for k, v in hf_model.items()})
    size = "tiny" if smoke else "llama-3.2-1b"
    return [
        Row("gpu-tests", "pytest", "pytest -m gpu (the tests marked gpu)", timeout=300),
        Row("1b-adamw", "train", f"{size} amp-bf16 remat full {_bt(b1)} AdamW", (*b1, *amp),
            timeout=300),
        Row("1b-adamw8bit", "train", "same, --optimizer adamw8bit",
            (*b1, *amp, "--optimizer", "adamw8bit"), timeout=300),
        Row("1b-fp8", "train", "same as 1b-adamw, --precision fp8",
            (*b1, "--precision", "fp8", "--remat", "full"), timeout=300),
        Row("8b-1x2048", "train", f"{'tiny' if smoke else 'llama-3-8b'} bf16-sr adamw8bit remat "
            f"full 1x{seq8[1]}", (*b8, *sr8, "--batch-size", "1", *seq8), timeout=420),
        Row("8b-4x2048", "train", f"same, 4x{seq8[1]}", (*b8, *sr8, "--batch-size", "4", *seq8),
            timeout=420),
        # issue 51's 1x2048 target with the update as one Pallas kernel per leaf (its numbers
        # against XLA's loop: tests/test_update_kernel.py's gpu test, in the gpu-tests row)
        Row("8b-1x2048-pallas", "train", "8b-1x2048 with --update-kernel pallas",
            (*b8, *sr8, "--batch-size", "1", *seq8, "--update-kernel", "pallas"), timeout=420),
        # issue 51's fp8 target: fp8's GEMMs on bf16-sr's weights, against 8b-4x2048
        Row("8b-fp8-sr-4x2048", "train", "8b-4x2048 with --precision fp8-sr",
            (*b8, "--precision", "fp8-sr", *sr8[2:], "--batch-size", "4", *seq8), timeout=420),
        # the 8B target's configuration (`--fit 80 --global-batch 8 --target h100` picks it):
        # remat full with the MLP whole
        Row("8b-8x2048-untiled", "train", f"same, 8x{seq8[1]}, --remat full+untiled",
            (*b8, *sr8, "--batch-size", "8", *seq8, "--remat", "full+untiled"), timeout=480),
        *(Row(f"8b-{name}", "train", f"8b-1x2048 with --optimizer-in-backward, {what} on the "
              f"host, {bs}x{seq8[1]}", (*b8, *sr8, "--batch-size", bs, *seq8,
                                       "--optimizer-in-backward", *flags),
              train=("--clip", "0"), timeout=420)
          for name, what, bs, flags in (
              ("opt-host", "optimizer state", "1", ("--offload-optimizer", "host")),
              ("both-host", "optimizer state and weights", "1",
               ("--offload-optimizer", "host", "--offload-params", "host")),
              ("both-host-4x", "optimizer state and weights", "4",
               ("--offload-optimizer", "host", "--offload-params", "host")))),
        Row("qlora-nf4", "train", f"LoRA r16 on a random {size}-shaped HF checkpoint, NF4 base + "
            f"double quant, amp-bf16 remat full {_bt(lora_seq)}",
            (*lora, "--quantize-base", "nf4", "--double-quant"), hf_flags, hf=True,
            timeout=300, needs=("tokenizers", "safetensors")),
        Row("lora-bf16", "train", "same LoRA, bf16 base (no quantization)",
            (*lora, "--quantize-base", "none"), hf_flags, hf=True, timeout=300,
            needs=("tokenizers", "safetensors")),
        Row("fp8-diag", "diag", "python -m experiments.fp8_diag --json (why fp8 is slow)",
            timeout=420),
        *(Row(f"compare-{r}", "compare", f"experiments.compare amp-bf16 remat {r}: jax, torch "
              f"eager{'' if smoke else ', torch.compile'}",
              args=(*cmp, "--modes", "amp-bf16", "--remats", r), timeout=480,
              needs=("torch",)) for r in ("none", "full")),
        Row("suite", "suite", "the whole test suite (pytest -n 8), every failure by name",
            timeout=1500.0),
    ]


def _bt(flags) -> str:
    f = dict(zip(flags[::2], flags[1::2]))
    return f"{f['--batch-size']}x{f['--seq-len']}"


# ---------------------------------------------------------------- reading results back


def last_record(metrics_file: Path) -> dict:
    """The last metrics.jsonl record of a run ({} when there is none)."""
    if not metrics_file.is_file():
        return {}
    lines = [ln for ln in metrics_file.read_text().splitlines() if ln.strip()]
    return json.loads(lines[-1]) if lines else {}


def train_metrics(rec: dict) -> dict:
    """tok/s, MFU and measured peak from a run's last record (jaxmem.train.loop writes `mfu`,
    `peak_bytes_in_use` and `state_peak_bytes_in_use`, the peak once the state was made, where
    the backend has them: a GPU)."""
    return {"tokens_per_s": rec.get("tokens_per_sec"), "mfu": rec.get("mfu"),
            "peak_bytes": rec.get("peak_bytes_in_use"),
            "state_peak_bytes": rec.get("state_peak_bytes_in_use"), "loss": rec.get("loss"),
            "eval_loss": rec.get("eval_loss")}


def plan_numbers(report: dict) -> dict:
    """The plan of `python -m jaxmem.memory --json`: analytic total, compiled peak (the run's
    largest phase where every phase was compiled, `--compile`; else the step's), the step's,
    backend, compiler (and the phases, when the planner reports them)."""
    step = report.get("compiled", {}).get("peak_bytes")
    ph = report.get("phases") or {}
    run_peak = ph.get("peak_bytes") if ph.get("peak_source") == "compiled" else None
    out = {"analytic_bytes": report.get("analytic", {}).get("total_bytes"),
           "compiled_bytes": run_peak or step, "step_bytes": step,
           "largest_phase": ph.get("peak_phase") if run_peak else "step",
           "backend": report.get("backend"), "compiler": report.get("compiler")}
    if ph:
        out["phases"] = ph
    return out


def target_card(gpu: str | None) -> str:
    """The jaxmem.target card of nvidia-smi's GPU name (`gpu_name()`), else h100."""
    from jaxmem.target._cards import CARDS  # noqa: PLC0415 (plain data: no jax)
    for name, card in CARDS.items():
        if gpu and gpu.split(",")[0].strip() == card.device_name:
            return name
    return "h100"


def target_installed() -> bool:
    """Whether XLA's GPU compiler (the CUDA plugin, `jaxmem[gpu-plan]`) is importable, without
    importing jax: the `--plan auto` choice (the child checks the rest and names what is missing)."""
    import importlib.util  # noqa: PLC0415
    return all(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin",
                                                                 "jax_plugins"))


def pytest_counts(text: str) -> dict:
    """Counts from pytest's last summary line, and the tests that failed or errored by name."""
    counts = {}
    summary = [ln for ln in text.splitlines() if re.search(r"\b(passed|failed|skipped|error|"
                                                          r"errors|deselected)\b.* in [\d.]+s", ln)]
    if summary:
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|"
                                  r"xpassed)", summary[-1]):
            counts["errors" if word.startswith("error") else word] = int(n)
    # -v with -n: "[gw3] [ 41%] FAILED tests/a.py::t"; -v alone: "tests/a.py::t FAILED [ 41%]";
    # the summary (-rfE): "FAILED tests/a.py::t - AssertionError"; "ERROR tests/b.py" (collection)
    def named(word):
        return dict.fromkeys(
            re.findall(rf"^(?:\[gw\d+\] (?:\[\s*\d+%\] )?)?{word} (\S+\.py(?:::\S+)?)", text,
                       re.M)
            + re.findall(rf"^(\S+\.py::\S+) {word}\b", text, re.M))
    failed, errors = named("FAILED"), named("ERROR")
    return {"counts": counts, "failed": list(failed), "errors": list(errors)}


def compare_numbers(doc: dict) -> tuple[dict, str, list[str]]:
    """(the jax run's metrics, a note with torch's, the runs that failed) of a compare JSON."""
    by = {r["spec"]["framework"]: r for r in doc.get("results", [])}
    j = by.get("jax", {})
    metrics = {"tokens_per_s": j.get("tokens_per_s"), "mfu": j.get("mfu"),
               "peak_bytes": j.get("peak_bytes")}
    parts = [f"saved for backward jax {_mib(j.get('saved_bytes'))}"]
    for fw, label in (("torch", "torch eager"), ("torch-compile", "torch.compile")):
        if fw in by and "error" not in by[fw]:
            t = by[fw]
            parts.append(f"{label} {t['tokens_per_s']:,.0f} tok/s, saved "
                         f"{_mib(t.get('saved_bytes'))}, peak {_gib(t.get('peak_bytes'))}")
    failed = [f"{fw}: {r['error'].splitlines()[-1][:300]}" for fw, r in by.items() if "error" in r]
    return metrics, "; ".join(parts), failed


def diag_note(doc: dict) -> str:
    """fp8_diag's fields in one cell: fp8 einsums traced vs f8 GEMM custom calls, top kernels."""
    parts = [f"fp8 einsums traced {doc.get('fp8_einsums_traced')}, "
             f"__cublas$lt$matmul$f8 calls {doc.get('f8_gemm_custom_calls')}"]
    top = doc.get("top_kernels") or []
    if top:
        parts.append("top kernels: " + ", ".join(f"{n[:60]} {ms:.1f} ms" for n, ms in top[:5]))
    rest = {k: v for k, v in doc.items()
            if k not in ("fp8_einsums_traced", "f8_gemm_custom_calls", "top_kernels")}
    if rest:
        parts.append(", ".join(f"{k} {json.dumps(v)[:80]}" for k, v in rest.items()))
    return "; ".join(parts)


def _mib(x):
    return "n/a" if x is None else f"{x / 2**20:,.0f} MiB" if x >= 100 * 2**20 else (
        f"{x / 2**20:.2f} MiB")


def _gib(x):
    return "n/a" if x is None else f"{x / GiB:.2f} GiB"


# ---------------------------------------------------------------- the random HF checkpoint


def make_hf(out: Path, shape: str) -> None:
    """A random Llama checkpoint of HF_SHAPES[shape] in `out` (bf16 safetensors, tokenizer)."""
    import ml_dtypes
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from jaxmem.families import get_preset
    from jaxmem.io.hf_export import save_hf
    from jaxmem.families.params import abstract_params, num_params
    import jax

    fields = dict(HF_SHAPES[shape])
    config = get_preset(fields.pop("preset")).replace(**fields)
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([Path(json.__file__).read_text()], trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single=f"{specials[0]} $A",
                                                       special_tokens=[(specials[0], 0)])
    (out / "tok").mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tok" / "tokenizer.json"))
    # A pool of normals, each tensor a window of it at a random offset: random enough for NF4 and
    # LoRA, and seconds instead of a minute for 1.2 B samples.
    rng = np.random.default_rng(0)
    # (not a power of two: stacked layers of 2**22 entries each would repeat one another exactly)
    pool = rng.standard_normal((1 << 22) + 9, dtype=np.float32) * 0.02

    def leaf(path, s):
        if "scale" in jax.tree_util.keystr(path):
            return np.ones(s.shape, ml_dtypes.bfloat16)
        n = math.prod(s.shape)
        reps = np.resize(np.roll(pool, int(rng.integers(pool.size))), n)
        return reps.reshape(s.shape).astype(ml_dtypes.bfloat16)  # 2.5 GB for the 1B, not 5

    params = jax.tree_util.tree_map_with_path(leaf, abstract_params(config))
    save_hf(out / "hf", config, params, dtype="bfloat16",
            tokenizer=str(out / "tok" / "tokenizer.json"), bos_token_id=0, eos_token_id=1)
    print(f"wrote {out / 'hf'}: {num_params(config):,} params", file=sys.stderr)
