"""TRL 1.16's own preference trainers as a reference for jaxmem's DPO / ORPO / SimPO: one batch,
computed by TRL's code on a (tiny) checkpoint, returned as plain Python values. Imported by name,
like hf_files.py; no tests here. torch / transformers / trl / peft / datasets are imported inside
the functions, so importing this module needs none of them.

    out = trl_batch("dpo", model_dir, rows)                          # reference: model copy
    out = trl_batch("dpo", model_dir, rows, ref_model_dir=ref_dir)   # reference: another model
    out = trl_batch("dpo", model_dir, rows, adapter_dir=lora_dir)    # policy base+LoRA, ref base
    out = trl_batch("orpo", model_dir, rows, orpo_lambda=0.1)
    out = trl_batch("simpo", model_dir, rows, beta=2.0, gamma=0.5)   # CPOTrainer, cpo_alpha=0

`rows`: TRL's preference rows, all in one format: standard {"prompt", "chosen", "rejected"}
strings, conversational message lists, or either without "prompt" (implicit prompt). The batch is
every row, in order (per_device_train_batch_size = len(rows) pairs, sequential sampler); the
trainer runs in fp32 on the CPU and does not train: its own dataloader yields the first batch, its
own compute_loss computes it under torch.no_grad with the model in train mode (dropout disabled by
TRL), and its own log() averages the metrics it stored, exactly as the first logging step of a
training run with logging_steps=1 would. What each trainer does is written down, with TRL's file
and line numbers, in tests/data/trl_preference_notes.md.

Returned keys (python floats / ints / lists):
  kind, n_pairs, reduction ("sum" for DPO, "mean" for ORPO / SimPO: how the per-pair log-probs
  are reduced over the completion tokens), loss, and every metric TRL logs for the batch under
  TRL's names (DPO: rewards/{chosen,rejected,accuracies,margins}, logps/{chosen,rejected},
  logits/{chosen,rejected}, entropy, mean_token_accuracy, num_tokens; ORPO: the same rewards /
  logps / logits plus nll_loss, log_odds_ratio, log_odds_chosen; SimPO: rewards / logps / logits
  plus nll_loss, 0.0 with cpo_alpha=0);
  per pair i (lists of length n_pairs):
    chosen_logps, rejected_logps        the policy's log-probs as the loss uses them
    ref_chosen_logps, ref_rejected_logps  (DPO only) the reference's
    chosen_input_ids, rejected_input_ids  the whole sequence fed to the model (no padding, after
                                         any truncation), prompt part + completion part
    chosen_logp_mask, rejected_logp_mask  1 where the token at that position counts in the
                                         log-prob (it is predicted from the position before)
    chosen_token_logps, rejected_token_logps  the policy's log-prob of each token of the sequence
                                         (0.0 at position 0 and where the mask is 0)
    nll_mask                            (ORPO only) 1 where a token of the chosen sequence counts
                                         in the NLL term (the token mean runs over all pairs)
    prompt_ids, rejected_prompt_ids     the prompt part of the chosen / rejected sequence (they
                                         differ only where a tokenizer merge or keep_end
                                         truncation made them differ)
    chosen_ids, rejected_ids            the completion part (what the log-probs cover, with any
                                         EOS TRL appended)
"""

from __future__ import annotations

import contextlib
import tempfile

KINDS = ("dpo", "orpo", "simpo")


def trl_batch(kind, model_dir, rows, *, tokenizer_dir=None, ref_model_dir=None, adapter_dir=None,
              adapter_reference="base", beta=0.1, gamma=0.5, orpo_lambda=0.1, label_smoothing=0.0,
              loss_type=None, max_length=None, max_prompt_length=None,
              truncation_mode="keep_start") -> dict:
    """TRL 1.16's loss, logged metrics and per-pair values for one batch made of `rows`.

    kind: "dpo" (DPOTrainer), "orpo" (experimental ORPOTrainer), "simpo" (experimental
      CPOTrainer with loss_type="simpo", cpo_alpha=0).
    model_dir: the policy checkpoint (loaded in fp32); tokenizer_dir: where the tokenizer is
      (default model_dir).
    DPO's reference: ref_model_dir (a separate model); adapter_dir (a saved peft LoRA adapter:
      the policy is model_dir + adapter, with adapter_reference="base" the reference is the base
      with the adapters disabled, as in TRL when it wraps the model itself from a `peft_config`
      (here the saved config, then the saved weights are loaded into that "default" adapter);
      with adapter_reference="copy" the PeftModel loaded from adapter_dir is passed to TRL,
      which then uses a frozen copy of the adapter as the reference (peft >= 0.20), i.e. the
      reference equals the policy at this step); neither: TRL loads a copy of model_dir.
    beta: DPOConfig.beta / CPOConfig.beta (SimPO's beta). gamma: CPOConfig.simpo_gamma (the
      SimPO paper's gamma; TRL subtracts gamma / beta from the log-prob difference, so the loss is
      -logsigmoid(beta * diff - gamma)). orpo_lambda: ORPOConfig.beta (the paper's lambda; ORPO
      also reports rewards as orpo_lambda * mean log-prob). label_smoothing: DPOConfig /
      CPOConfig.label_smoothing (DPO's "sigmoid" ignores it: only "robust", "exo_pair", "aot*"
      read it). loss_type: DPOConfig.loss_type (default "sigmoid"); not accepted for orpo/simpo.
    max_length: the config's max_length (None: the config default, 1024 in all three);
      truncation_mode: DPOConfig.truncation_mode (DPO only). max_prompt_length: TRL 1.16 has no
      such option in any of the three configs, so anything but None raises.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if max_prompt_length is not None:
        raise ValueError("TRL 1.16 has no max_prompt_length (DPOConfig, ORPOConfig and CPOConfig "
                         "dropped it); use max_length")
    if kind != "dpo" and (ref_model_dir is not None or adapter_dir is not None):
        raise ValueError("ref_model_dir / adapter_dir are DPO's (ORPO and SimPO have no reference)")
    if ref_model_dir is not None and adapter_dir is not None:
        raise ValueError("give ref_model_dir or adapter_dir, not both")
    if adapter_reference not in ("base", "copy"):
        raise ValueError(f"adapter_reference must be 'base' or 'copy', got {adapter_reference!r}")
    if kind == "orpo" and (loss_type is not None or label_smoothing):
        raise ValueError("ORPOTrainer has no loss_type / label_smoothing")
    if kind != "dpo" and truncation_mode != "keep_start":
        raise ValueError("ORPO / CPO have no truncation_mode (they cut the completion end)")
    if kind == "simpo" and loss_type not in (None, "simpo"):
        raise ValueError("kind='simpo' is CPOTrainer's loss_type='simpo'")
    if not rows:
        raise ValueError("rows is empty")

    import torch
    from datasets import Dataset

    with _quiet(), tempfile.TemporaryDirectory(prefix="trl-pref-") as out_dir:
        common = dict(output_dir=out_dir, per_device_train_batch_size=len(rows),
                      gradient_accumulation_steps=1, bf16=False, fp16=False, use_cpu=True,
                      report_to="none", gradient_checkpointing=False,
                      train_sampling_strategy="sequential", dataloader_num_workers=0,
                      disable_tqdm=True, logging_steps=1, save_strategy="no")
        if max_length is not None:
            common["max_length"] = max_length
        dataset = Dataset.from_list([dict(r) for r in rows])
        tokenizer = _tokenizer(tokenizer_dir or model_dir)
        if kind == "dpo":
            trainer, ref_note = _dpo_trainer(model_dir, dataset, tokenizer, common, ref_model_dir,
                                             adapter_dir, adapter_reference, beta, label_smoothing,
                                             loss_type, truncation_mode)
        else:
            trainer = _cpo_orpo_trainer(kind, model_dir, dataset, tokenizer, common, beta, gamma,
                                        orpo_lambda, label_smoothing)
            ref_note = None
        _drop_printing_callbacks(trainer)

        batch = next(iter(trainer.get_train_dataloader()))
        batch = trainer._prepare_inputs(batch)
        trainer.model.train()  # as Trainer.training_step does
        captured, hooks = _capture_outputs(trainer)
        try:
            with torch.no_grad(), trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(trainer.model, batch)
        finally:
            for h in hooks:
                h.remove()
        loss = loss.detach().float().item()
        n_logs = len(trainer.state.log_history)
        trainer.log({"loss": loss})  # TRL's own averaging of the metrics it stored
        logged = dict(trainer.state.log_history[n_logs])
        logged.pop("step", None)
        logged.pop("epoch", None)

        result = {"kind": kind, "reduction": "sum" if kind == "dpo" else "mean", **logged,
                  "loss": loss}
        if kind == "dpo":
            result.update(_dpo_pairs(trainer, batch, captured))
            result["reference"] = ref_note
        else:
            result.update(_cpo_orpo_pairs(trainer, kind, batch, captured))
        return result


# ----------------------------------------------------------------------------- trainers

def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _load_model(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def _dpo_trainer(model_dir, dataset, tokenizer, common, ref_model_dir, adapter_dir,
                 adapter_reference, beta, label_smoothing, loss_type, truncation_mode):
    from trl import DPOConfig, DPOTrainer

    model = _load_model(model_dir)
    ref_model = peft_config = None
    if ref_model_dir is not None:
        ref_model = _load_model(ref_model_dir)
        note = "ref_model"
    elif adapter_dir is not None and adapter_reference == "base":
        from peft import PeftConfig

        peft_config = PeftConfig.from_pretrained(str(adapter_dir))
        peft_config.inference_mode = False
        note = "base model, adapters disabled"
    elif adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
        note = "frozen copy of the adapter ('ref' adapter)"
    else:
        note = "copy of the model loaded from model_dir"
    args = DPOConfig(**common, beta=beta, label_smoothing=label_smoothing,
                     loss_type=loss_type or "sigmoid", truncation_mode=truncation_mode)
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=dataset,
                         processing_class=tokenizer, peft_config=peft_config)
    if peft_config is not None:
        # TRL made a fresh adapter (lora_B = 0); put the saved weights into it.
        from peft import load_peft_weights, set_peft_model_state_dict

        res = set_peft_model_state_dict(trainer.model, load_peft_weights(str(adapter_dir)),
                                        adapter_name="default")
        if getattr(res, "unexpected_keys", None):
            raise RuntimeError(f"adapter keys not loaded: {res.unexpected_keys}")
    return trainer, note


def _cpo_orpo_trainer(kind, model_dir, dataset, tokenizer, common, beta, gamma, orpo_lambda,
                      label_smoothing):
    model = _load_model(model_dir)
    # Both build their collator (DPODataCollatorWithPadding, which refuses a None pad id) from the
    # tokenizer's pad token before anything falls back to EOS (ORPO never does; CPO does only
    # after, cpo_trainer.py:310 vs 337), so a tokenizer without a pad token fails in TRL itself.
    # The pad id only fills positions that are masked out. remove_unused_columns=False: what both
    # set themselves for that collator (with a warning).
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    common = dict(common, remove_unused_columns=False)
    if kind == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        args = ORPOConfig(**common, beta=orpo_lambda)
        return ORPOTrainer(model=model, args=args, train_dataset=dataset,
                           processing_class=tokenizer)
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    args = CPOConfig(**common, loss_type="simpo", cpo_alpha=0.0, beta=beta, simpo_gamma=gamma,
                     label_smoothing=label_smoothing)
    return CPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)


def _drop_printing_callbacks(trainer):
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)


def _capture_outputs(trainer):
    """Forward hooks that keep each output of the policy (and of the separate reference model)."""
    captured = {"policy": [], "ref": []}

    def keep(name):
        def hook(module, args, output):
            captured[name].append(output)
        return hook

    hooks = [trainer.model.register_forward_hook(keep("policy"))]
    if getattr(trainer, "ref_model", None) is not None:
        hooks.append(trainer.ref_model.register_forward_hook(keep("ref")))
    return captured, hooks


# ----------------------------------------------------------------------------- per-pair values

def _ints(t):
    return [int(x) for x in t.tolist()]


def _floats(t):
    return [float(x) for x in t.tolist()]


def _split(seq, mask):
    """seq = prompt part + completion part (mask 0...0 1...1): the two parts."""
    k = mask.index(1) if 1 in mask else len(mask)
    return seq[:k], seq[k:]


def _dpo_pairs(trainer, batch, captured):
    # The policy's forward is the first captured call; the reference's is the second call of the
    # policy module (PEFT, adapters disabled or "ref" adapter) or the ref_model's only call.
    seq_len = batch["completion_mask"].shape[1] - 1
    policy = captured["policy"][0].log_probs[:, -seq_len:].float()
    ref_out = captured["ref"][0] if captured["ref"] else captured["policy"][1]
    ref = ref_out.log_probs[:, -seq_len:].float()
    n = batch["input_ids"].shape[0] // 2
    out = {"n_pairs": n}
    sums, ref_sums = policy.sum(dim=1), ref.sum(dim=1)  # dpo_trainer.py:1304, 1341
    out["chosen_logps"], out["rejected_logps"] = _floats(sums[:n]), _floats(sums[n:])
    out["ref_chosen_logps"] = _floats(ref_sums[:n])
    out["ref_rejected_logps"] = _floats(ref_sums[n:])
    for side, rows in (("chosen", range(n)), ("rejected", range(n, 2 * n))):
        seqs, masks, tok_lps, prompts, comps = [], [], [], [], []
        for r in rows:
            length = int(batch["attention_mask"][r].sum())
            seq = _ints(batch["input_ids"][r, :length])
            mask = _ints(batch["completion_mask"][r, :length])
            lps = [0.0] + _floats(policy[r, :length - 1])
            lps = [lp if m else 0.0 for lp, m in zip(lps, mask)]
            p, c = _split(seq, mask)
            seqs.append(seq), masks.append(mask), tok_lps.append(lps)
            prompts.append(p), comps.append(c)
        out[f"{side}_input_ids"], out[f"{side}_logp_mask"] = seqs, masks
        out[f"{side}_token_logps"], out[f"{side}_ids"] = tok_lps, comps
        out["prompt_ids" if side == "chosen" else "rejected_prompt_ids"] = prompts
    return out


def _cpo_orpo_pairs(trainer, kind, batch, captured):
    from trl.trainer.utils import selective_log_softmax

    logits = captured["policy"][0].logits.float()
    cat = trainer.concatenated_inputs(batch, is_encoder_decoder=False,
                                      padding_value=trainer.padding_value if kind == "orpo"
                                      else trainer.pad_token_id, device=logits.device)
    labels = cat["concatenated_labels"]
    # TRL's own reduction of the same logits (orpo_trainer.py:802, cpo_trainer.py:845)
    avg = trainer.get_batch_logps(logits, labels, average_log_prob=True, is_encoder_decoder=False)
    n = batch["chosen_labels"].shape[0]
    out = {"n_pairs": n, "chosen_logps": _floats(avg[:n]), "rejected_logps": _floats(avg[n:])}
    shifted = labels[:, 1:]
    per_token = selective_log_softmax(logits[:, :-1], shifted.clamp(min=0))
    nll_masks = []
    for side, rows in (("chosen", range(n)), ("rejected", range(n, 2 * n))):
        seqs, masks, tok_lps, prompts, comps = [], [], [], [], []
        for r in rows:
            length = int(cat["concatenated_attention_mask"][r].sum())
            seq = _ints(cat["concatenated_input_ids"][r, :length])
            mask = [0] + [int(x != -100) for x in shifted[r, :length - 1].tolist()]
            lps = [0.0] + _floats(per_token[r, :length - 1])
            lps = [lp if m else 0.0 for lp, m in zip(lps, mask)]
            p, c = _split(seq, mask)
            seqs.append(seq), masks.append(mask), tok_lps.append(lps)
            prompts.append(p), comps.append(c)
            if side == "chosen":  # orpo_trainer.py:796-800: every attended token after the first
                nll_masks.append([0] + [1] * (length - 1))
        out[f"{side}_input_ids"], out[f"{side}_logp_mask"] = seqs, masks
        out[f"{side}_token_logps"], out[f"{side}_ids"] = tok_lps, comps
        out["prompt_ids" if side == "chosen" else "rejected_prompt_ids"] = prompts
    if kind == "orpo":
        out["nll_mask"] = nll_masks
    return out


# ----------------------------------------------------------------------------- quiet

@contextlib.contextmanager
def _quiet():
    """No progress bars, no info logs, no FutureWarnings, no telemetry ping (no network here) while
    TRL runs; the previous settings come back afterwards."""
    import warnings

    import datasets
    import huggingface_hub.constants as hub_constants
    import transformers

    bars = datasets.is_progress_bar_enabled()
    hf_bars = transformers.utils.logging.is_progress_bar_enabled()
    verbosity = transformers.logging.get_verbosity()
    telemetry = hub_constants.HF_HUB_DISABLE_TELEMETRY
    datasets.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    hub_constants.HF_HUB_DISABLE_TELEMETRY = True
    try:
        with warnings.catch_warnings():
            # TRL's configs default gradient_checkpointing=True (deprecated in transformers 5)
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        hub_constants.HF_HUB_DISABLE_TELEMETRY = telemetry
        transformers.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bar()
        if hf_bars:
            transformers.utils.logging.enable_progress_bar()
