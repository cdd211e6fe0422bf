"""The PyTorch training recipe practitioners know, on the jaxmem Llama, for side-by-side runs.

    AdamW(betas=(0.9, 0.95), eps=1e-8), weight decay on 2-D+ matrices except the embedding
    LambdaLR: linear warmup from 0, then cosine decay to a floor (optax's
        warmup_cosine_decay_schedule(0, lr, warmup, steps, min_lr), step for step)
    torch.autocast (bf16 or fp16) + torch.amp.GradScaler for fp16
    torch.utils.checkpoint per decoder layer (model.gradient_checkpointing)

Modes are named like jaxmem's precision modes:

    fp32      fp32 params, fp32 compute
    bf16      pure bf16: model built under torch.set_default_dtype(torch.bfloat16), so params,
              gradients and AdamW state are bf16 (no master copy)
    amp-bf16  fp32 params, torch.autocast(dtype=torch.bfloat16), no loss scaling
    amp-fp16  fp32 params, torch.autocast(dtype=torch.float16) + GradScaler

One amp-fp16 step, in the only order that is right:

    scaler.scale(loss).backward()
    scaler.unscale_(opt)                  # grads back to true values, found_inf recorded
    norm = clip_grad_norm_(params, clip)  # clip the *unscaled* gradients
    scaler.step(opt)                      # runs opt.step() iff no inf/nan was found
    skipped = found_inf > 0               # read BEFORE update(), which clears it
    scaler.update()                       # backoff on inf, growth after 2000 clean steps
    if not skipped: sched.step()          # a skipped step must not advance the schedule

Detecting the skip by comparing `scaler.get_scale()` before and after `update()` is a common
idiom and it is wrong: the scale is a *consequence* of found_inf through update(), and the two
decouple (a run stuck on a NaN loss whose scale has underflowed to 0, where backoff no longer
moves it; a scale set by hand; one scaler shared by several optimizers, where the scale backs off
if any of them overflowed). GradScaler.step itself skips iff
`sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0`, so that is what we read.
`tests/test_torch_parity.py::test_skip_detection_reads_found_inf` shows the scale rule failing
(scale stuck at 0).

A quick CPU run (the model is `tiny`; bf16/fp16 memory and speed claims need a GPU):

    python -m experiments.compare.torch_train --mode amp-bf16 --steps 20

prints one line per step (loss, grad norm, lr, scale, skipped) and the bytes saved for backward
with and without per-layer checkpointing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import math
from typing import Iterable

import numpy as np
import torch

from experiments.compare.torch_llama import LlamaForCausalLM, loss as lm_loss
from jaxmem.families.config import ModelConfig

MODES = ("fp32", "bf16", "amp-bf16", "amp-fp16")
_AUTOCAST = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch.set_default_dtype for the duration of a block (restored even on error)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(config: ModelConfig, mode: str, gradient_checkpointing: bool = False,
                seed: int = 0, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """The model in the dtype its mode stores params in (bf16 for `bf16`, else fp32)."""
    _check_mode(mode)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    with default_dtype(dtype):
        model = LlamaForCausalLM(config, gradient_checkpointing=gradient_checkpointing)
    return model.to(device)


def autocast(mode: str, device_type: str):
    """The forward-pass context of a mode: torch.autocast for amp-*, nothing otherwise."""
    _check_mode(mode)
    if mode in _AUTOCAST:
        return torch.autocast(device_type=device_type, dtype=_AUTOCAST[mode])
    return contextlib.nullcontext()


def lr_at(step: int, lr: float, warmup: int, total: int, min_lr: float) -> float:
    """Learning rate of optimizer step `step` (0-based): 0 -> lr linearly over `warmup` steps,
    then cosine from lr to min_lr at step `total`, min_lr after (optax's
    warmup_cosine_decay_schedule with init_value 0 and decay_steps=total)."""
    if step < warmup:
        return lr * step / warmup
    decay = max(total - warmup, 1)
    t = min(step - warmup, decay)
    alpha = min_lr / lr if lr else 0.0
    return lr * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * t / decay)) + alpha)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D+ matrices; no decay on norms (1-D) and the embedding (tied head included)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "embed_tokens" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


@dataclasses.dataclass
class Recipe:
    """Everything a PyTorch training step touches; `state_dict()` is the whole checkpoint."""

    model: LlamaForCausalLM
    mode: str
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    clip: float | None
    step_count: int = 0  # optimizer steps taken (skipped steps not counted)

    @property
    def device_type(self) -> str:
        return next(self.model.parameters()).device.type

    def step(self, batch) -> dict:
        """One training step on a batch dict (inputs, targets, optional mask)."""
        model, opt, scaler = self.model, self.optimizer, self.scaler
        device = next(model.parameters()).device
        inputs, targets, mask = (_as_long(batch.get(k), device) for k in ("inputs", "targets",
                                                                         "mask"))
        if mask is None:
            mask = torch.ones_like(targets)
            padding = None
        else:
            padding = mask
        lr = opt.param_groups[0]["lr"]
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        opt.zero_grad(set_to_none=True)
        model.train()
        with autocast(self.mode, device.type):
            logits = model(inputs, padding_mask=padding)  # [B, T, V] fp32
        loss = lm_loss(logits, targets, mask)  # fp32, outside autocast
        scaler.scale(loss).backward()  # scale() is the identity when the scaler is disabled
        if scaler.is_enabled():
            scaler.unscale_(opt)
        params = [p for g in opt.param_groups for p in g["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip if self.clip else math.inf)
        if scaler.is_enabled():
            scaler.step(opt)
            skipped = sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0
            scaler.update()
        else:
            opt.step()
            skipped = False
        if not skipped:
            self.scheduler.step()
            self.step_count += 1
        return {"loss": float(loss.detach()), "grad_norm": float(grad_norm), "lr": float(lr),
                "scale": float(scale), "skipped": bool(skipped)}

    def state_dict(self) -> dict:
        """Model, optimizer, scheduler, GradScaler state and the step count (torch.save-able)."""
        return {"mode": self.mode, "step_count": self.step_count,
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["mode"] != self.mode:
            raise ValueError(f"checkpoint was written in mode {state['mode']!r}, not {self.mode!r}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:  # a disabled scaler saves {}
            self.scaler.load_state_dict(state["scaler"])
        self.step_count = int(state["step_count"])


def make_recipe(model: LlamaForCausalLM, mode: str, steps: int, lr: float, warmup: int,
                min_lr: float, weight_decay: float, clip: float | None,
                init_scale: float = 2.0 ** 16) -> Recipe:
    """AdamW + LambdaLR (+ GradScaler for amp-fp16) for `model`, whose dtype must fit `mode`."""
    _check_mode(mode)
    want = torch.bfloat16 if mode == "bf16" else torch.float32
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {want}:
        raise ValueError(f"mode {mode!r} needs {want} params, the model has {sorted(map(str, dtypes))}"
                         f" (build it with experiments.compare.torch_train.build_model(config, {mode!r}))")
    opt = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_at(s, lr, warmup, steps, min_lr) / lr if lr else 0.0)
    device_type = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, enabled=mode == "amp-fp16")
    return Recipe(model, mode, opt, sched, scaler, clip)


def train_steps(model: LlamaForCausalLM, batches: Iterable[dict], mode: str, steps: int,
                lr: float, warmup: int, min_lr: float, weight_decay: float,
                clip: float | None, *, recipe: Recipe | None = None) -> list[dict]:
    """Train `steps` steps, cycling through `batches`; one dict per step:
    loss (unscaled, fp32), grad_norm (before clipping, of the unscaled grads), lr and scale
    (the values this step used), skipped (found inf/nan: params, AdamW state and schedule
    untouched). Pass `recipe` (from make_recipe) to continue an earlier run."""
    if recipe is None:
        recipe = make_recipe(model, mode, steps, lr, warmup, min_lr, weight_decay, clip)
    elif recipe.model is not model or recipe.mode != mode:
        raise ValueError("recipe was made for another model or mode")
    return [recipe.step(b) for b in itertools.islice(itertools.cycle(batches), steps)]


def save_checkpoint(path, recipe: Recipe) -> None:
    """Write the whole recipe state (GradScaler's scale and growth tracker included)."""
    torch.save(recipe.state_dict(), path)


def load_checkpoint(path, recipe: Recipe) -> None:
    """Restore a save_checkpoint file into a recipe built the same way (weights_only load)."""
    recipe.load_state_dict(torch.load(path, weights_only=True, map_location="cpu"))


class SelectiveCheckpoint:
    """Selective activation checkpointing for `model.checkpoint_context_fn`: inside each
    checkpointed layer keep the matmul outputs (q/k/v/o, gate/up/down projections) and the
    attention output and its logsumexp; recompute everything else (RoPE, norms, SiLU, casts).

    This is torch's counterpart of jaxmem's `names:query,key,value,attn_context,mlp_gate,mlp_up`
    (which does not keep o_proj/down_proj outputs, [B, T, D] each). What the policy keeps lives
    in the checkpoint's own cache, not in autograd's saved tensors, so `saved_tensors_hooks` never
    sees it: `saved_bytes` adds up its size as the forward runs (reset it before a forward).
    """

    def __init__(self):
        aten = torch.ops.aten
        self.save_ops = {aten.mm.default, aten.addmm.default, aten.bmm.default}
        self.attention_ops = {getattr(aten, n).default for n in (
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
            if hasattr(aten, n)}
        self.saved_bytes = 0

    def _out_bytes(self, op, args) -> int:
        if op in self.attention_ops:  # output [B, N, T, H] in q's dtype + fp32 logsumexp [B, N, T]
            q = args[0]
            return q.numel() * q.element_size() + q.numel() // q.shape[-1] * 4
        a, b = args[-2], args[-1]  # mm(a, b), addmm(bias, a, b), bmm(a, b)
        return a.numel() // a.shape[-1] * b.shape[-1] * a.element_size()

    def policy(self, ctx, op, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy
        if op in self.save_ops or op in self.attention_ops:
            if not ctx.is_recompute:
                self.saved_bytes += self._out_bytes(op, args)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn(self):
        """checkpoint's context_fn: a functools.partial, which torch.compile can trace (a
        callable object it cannot: "checkpoint not implemented for ... context_fn")."""
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        return functools.partial(create_selective_checkpoint_contexts, self.policy)


def set_remat(model: LlamaForCausalLM, remat: str) -> None:
    """none: no checkpointing; full: per-layer torch.utils.checkpoint; selective: per-layer
    checkpoint with SelectiveCheckpoint's policy."""
    if remat not in ("none", "full", "selective"):
        raise ValueError(f"unknown torch remat {remat!r}; choose none, full or selective")
    model.gradient_checkpointing = remat != "none"
    model.selective_checkpoint = SelectiveCheckpoint() if remat == "selective" else None
    model.checkpoint_context_fn = (model.selective_checkpoint.context_fn()
                                   if model.selective_checkpoint else None)


_VIEW_OR_COPY = {"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0",
                 "PermuteBackward0", "UnsafeViewBackward0", "ExpandBackward0", "AliasBackward0",
                 "ReshapeAliasBackward0"}


def _is_param_copy(t: torch.Tensor) -> bool:
    """True for a cast copy (or a view of one) of a parameter, e.g. autocast's bf16 weights:
    its autograd history is only casts and views back to a leaf (AccumulateGrad)."""
    fn = t.grad_fn
    for _ in range(6):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return True
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if name not in _VIEW_OR_COPY or len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


def saved_bytes_for_backward(model: LlamaForCausalLM, batch: dict, mode: str,
                             include_params: bool = False,
                             exclude_param_copies: bool = False,
                             count_selective: bool = True) -> int:
    """Bytes of the tensors autograd keeps for backward during one forward + loss.

    Every tensor packed by autograd is seen by a `saved_tensors_hooks` pack hook; we sum the
    nbytes of their unique storages (by data_ptr: views and re-saves of one buffer count once).
    Parameters' own storages are excluded unless include_params; autocast's low-precision weight
    copies are not parameters and count unless exclude_param_copies. With non-reentrant
    checkpointing, the checkpoint keeps each layer's inputs (packed by our hook) and its own hook
    replaces ours inside the layer, so the recomputed activations are, rightly, not counted; what
    a SelectiveCheckpoint policy keeps is added from its own count (unless count_selective is
    False: under torch.compile the compiled graph saves those tensors through the hooks itself,
    and the policy runs at trace time only).
    """
    device = next(model.parameters()).device
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if include_params or not (s.data_ptr() in param_ptrs
                                  or (exclude_param_copies and _is_param_copy(t))):
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        return t

    sac = getattr(model, "selective_checkpoint", None) if model.gradient_checkpointing else None
    if isinstance(sac, SelectiveCheckpoint):
        sac.saved_bytes = 0
    inputs, targets, mask = (_as_long(batch.get(k), device) for k in ("inputs", "targets", "mask"))
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast(mode, device.type):
            logits = model(inputs, padding_mask=mask)
        out = lm_loss(logits, targets, mask if mask is not None else torch.ones_like(targets))
    del out, logits  # drop the graph without a backward
    extra = sac.saved_bytes if count_selective and isinstance(sac, SelectiveCheckpoint) else 0
    return sum(storages.values()) + extra


def _as_long(x, device):
    if x is None:
        return None
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x))
    return t.to(device=device, dtype=torch.long)


def random_batches(config: ModelConfig, n: int, batch_size: int, seq_len: int, seed: int = 0,
                   pad: int = 0) -> list[dict]:
    """n random batches; the last `pad` positions of every row are padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tok = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=g)
        mask = (torch.arange(seq_len) < seq_len - pad).long().expand(batch_size, seq_len)
        out.append({"inputs": tok[:, :-1], "targets": tok[:, 1:], "mask": mask})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.compare.torch_train",
                                description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="fp32", choices=MODES)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpointing", action="store_true")
    args = p.parse_args(argv)
    cfg = ModelConfig()  # the `tiny` preset
    model = build_model(cfg, args.mode, args.checkpointing)
    # The same 4 batches over and over: the loss must fall fast.
    batches = random_batches(cfg, 4, args.batch_size, args.seq_len)
    for i, r in enumerate(train_steps(model, batches, args.mode, args.steps, args.lr,
                                      warmup=max(args.steps // 10, 1), min_lr=args.lr / 10,
                                      weight_decay=0.1, clip=1.0)):
        print(f"step {i:4d} loss {r['loss']:.4f} grad_norm {r['grad_norm']:.3f} "
              f"lr {r['lr']:.2e} scale {r['scale']:g}{' SKIPPED' if r['skipped'] else ''}")
    for ckpt in (False, True):
        model.gradient_checkpointing = ckpt
        mib = saved_bytes_for_backward(model, batches[0], args.mode) / 2 ** 20
        print(f"saved for backward, checkpointing={ckpt}: {mib:.2f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
