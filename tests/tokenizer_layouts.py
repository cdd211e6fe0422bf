"""Tiny Hugging Face checkpoint directories laid out as each model family publishes its own: the
family's real special tokens (names, order, special / non-special), its tokenizer.json pipeline
and post-processor, its published tokenizer_config.json settings, its real chat template (from
tests/data/chat_templates/, sources in the README there), special_tokens_map.json where the
family's Hub repo has one, generation_config.json, and a config.json of a tiny model of the
family (weights too with `with_weights=True`). Imported by name, like hf_files.py.

    info = write_layout(name, directory, with_weights=False)    # name in LAYOUTS or BARE

Only the vocabularies are tiny: BPE trained here on a short text. Their ids are not the
published ids (Llama 3's <|eot_id|> is not 128009 here); the special tokens keep the published
order and position (after the vocabulary for Llama 3 and Qwen, at ids 0... for Mistral, Gemma
and SmolLM2), and config.json / generation_config.json name the same tokens the published files
name by id. Each pipeline is the family's own (byte-level BPE with Llama 3's / Qwen's split
regex and GPT-2's byte-level for SmolLM2; SentencePiece-style BPE with byte fallback for Mistral
and Gemma), because transformers 5 rebuilds the normalizer / pre-tokenizer / decoder of a
LlamaTokenizer, GemmaTokenizer, Qwen2Tokenizer or GPT2Tokenizer from its class and keeps only the
vocabulary, merges and post-processor of tokenizer.json: a file whose pipeline were not the
class's would tokenize differently in transformers than in the `tokenizers` library.

Published values (see tests/data/chat_templates/README.md for where each was read, and which
were not found in a published copy and are reconstructed):

  llama3.1-instruct   BOS <|begin_of_text|> added by tokenizer.json's TemplateProcessing
                      post-processor (tokenizer_config.json has no add_bos_token); eos_token
                      <|eot_id|>; no pad token; config.json bos <|begin_of_text|>, eos
                      [<|end_of_text|>, <|eom_id|>, <|eot_id|>]; generation_config the same.
  qwen2.5-instruct    bos_token null, add_bos_token false, ByteLevel post-processor (adds
  qwen3               nothing); eos_token <|im_end|>, pad_token <|endoftext|>; config.json names
                      <|endoftext|> as bos_token_id (the trap: the tokenizer adds no BOS) and
                      <|im_end|> as eos; generation_config eos [<|im_end|>, <|endoftext|>].
                      Qwen3 adds <think> / </think> as added, non-special tokens, and ships its
                      template as chat_template.jinja here (the transformers 5 form).
  mistral-v0.3-instruct  <unk> <s> </s> [INST] [/INST] ... as control tokens at ids 0...,
                      add_bos_token true (post-processor "<s> $A"); config / generation bos <s>,
                      eos </s>.
  gemma3-it           <pad> <eos> <bos> <unk> <mask> ... <start_of_turn> <end_of_turn> at ids
                      0...; add_bos_token true (post-processor "<bos> $A") and the template writes
                      {{ bos_token }} itself; generation_config eos [<eos>, <end_of_turn>] (the
                      published [1, 106]). The vocabulary also holds <s> and </s> as ordinary,
                      non-special pieces, as Gemma's does: a loader that guesses BOS/EOS by name
                      from a list that tries <s> before <bos> picks the wrong token.
  smollm2-instruct    ChatML; bos_token <|im_start|> (tokenizer_config.json) that the GPT-2-style
                      tokenizer never adds; eos <|im_end|>, pad <|im_end|>, unk <|endoftext|>;
                      config.json bos 1 eos 2; generation_config bos 1 eos 2 pad 2.
  bare                tokenizer.json alone, special tokens named <|doc|>, <|stop|>, <|fill|>
                      (none of the usual names); the post-processor adds <|doc|>.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
LAYOUTS = ("llama3.1-instruct", "qwen2.5-instruct", "qwen3", "mistral-v0.3-instruct",
           "gemma3-it", "smollm2-instruct")
BARE = "bare"

# The split regexes of the published tokenizer.json files (Llama 3: \p{N}{1,3}; Qwen: \p{N}).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Conversations (3 user/assistant turns; SYSTEM is prepended where a test wants one).
SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one line."}
TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And how many legs does a spider have?"},
    {"role": "assistant", "content": "A spider has 8 legs."},
    {"role": "user", "content": "Say hello in Japanese: héllo wörld — 日本語?"},
    {"role": "assistant", "content": "こんにちは! That is hello."},
]
PROMPTS = ["The quick brown fox jumps over the lazy dog.",
           " leading space, then 12345 and 3.14159",
           "héllo wörld — 日本語?\nnew line\n\n  indented  "]

_EXTRA = """Cutting Knowledge Date: December 2023
Today Date: 26 Jul 2024
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.
You are a helpful AI assistant named SmolLM, trained by Hugging Face
system user assistant model
def main():
    return 0
The cat sat on the mat. The dog ran in the park. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000.
"""


def training_text() -> str:
    words = " ".join(m["content"] for m in [SYSTEM, *TURNS])
    return "\n".join([words, *PROMPTS, _EXTRA] * 3)


# ----------------------------------------------------------------------------- families

@dataclass(frozen=True)
class Family:
    """A family's published layout; token ids are written as the token strings."""

    pipeline: str                  # "llama3" | "qwen" | "gpt2" | "mistral" | "gemma"
    added: tuple                   # ((content, special), ...) in id order
    added_first: bool              # at ids 0... (else after the trained vocabulary)
    bos_template: str | None       # the token the post-processor adds, or None
    tokenizer_config: dict         # published keys (chat_template / added_tokens_decoder added)
    template: str | None           # file under tests/data/chat_templates
    template_in: str = "config"    # "config" (inline, as the Hub had it) or "jinja"
    special_tokens_map: dict | None = None
    config: dict = field(default_factory=dict)       # config.json token ids, as strings
    generation: dict = field(default_factory=dict)   # generation_config.json, ids as strings
    model: str = "llama"           # the tiny model's transformers config class (_model_config)
    ordinary: tuple = ()           # extra ordinary (non-added) vocabulary pieces
    vocab_size: int = 420          # BPE trainer's target


def _added(names, special=True):
    return tuple((n, special) for n in names)


def _map_token(content):
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False}


LLAMA31_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                    "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                 "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                 "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                 "<|image_pad|>", "<|video_pad|>"]
QWEN25_PLAIN = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
                "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
QWEN3_PLAIN = QWEN25_PLAIN + ["<tool_response>", "</tool_response>", "<think>", "</think>"]
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                    "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                    "[/TOOL_RESULTS]", "[control_8]", "[control_9]"]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[@BOS@]", "<unused0>",
                  "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                  "<image_soft_token>"]
SMOLLM2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>",
                    "<file_sep>", "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>",
                    "<issue_closed>", "<jupyter_start>", "<jupyter_text>", "<jupyter_code>",
                    "<jupyter_output>", "<jupyter_script>", "<empty_output>"]
BARE_SPECIALS = ["<|doc|>", "<|stop|>", "<|fill|>"]

_QWEN_CONFIG = {"add_bos_token": False, "add_prefix_space": False,
                "additional_special_tokens": QWEN_SPECIALS[1:], "bos_token": None,
                "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
                "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
                "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
                "unk_token": None}
_SP_MAX = 1000000000000000019884624838656  # transformers' VERY_LARGE_INTEGER, as published

FAMILIES = {
    "llama3.1-instruct": Family(
        pipeline="llama3", added=_added(LLAMA31_SPECIALS), added_first=False,
        bos_template="<|begin_of_text|>",
        tokenizer_config={"bos_token": "<|begin_of_text|>", "clean_up_tokenization_spaces": True,
                          "eos_token": "<|eot_id|>",
                          "model_input_names": ["input_ids", "attention_mask"],
                          "model_max_length": 131072,
                          "tokenizer_class": "PreTrainedTokenizerFast"},
        template="meta-llama-Llama-3.1-8B-Instruct.jinja",
        special_tokens_map={"bos_token": _map_token("<|begin_of_text|>"),
                            "eos_token": _map_token("<|eot_id|>")},
        config={"bos_token_id": "<|begin_of_text|>",
                "eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]},
        generation={"bos_token_id": "<|begin_of_text|>", "do_sample": True,
                    "eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
                    "temperature": 0.6, "top_p": 0.9},
        model="llama3"),
    "qwen2.5-instruct": Family(
        pipeline="qwen", added=_added(QWEN_SPECIALS) + _added(QWEN25_PLAIN, False),
        added_first=False, bos_template=None, tokenizer_config=dict(_QWEN_CONFIG),
        template="Qwen-Qwen2.5-7B-Instruct.jinja",
        config={"bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>"},
        generation={"bos_token_id": "<|endoftext|>", "pad_token_id": "<|endoftext|>",
                    "do_sample": True, "eos_token_id": ["<|im_end|>", "<|endoftext|>"],
                    "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20},
        model="qwen2"),
    "qwen3": Family(
        pipeline="qwen", added=_added(QWEN_SPECIALS) + _added(QWEN3_PLAIN, False),
        added_first=False, bos_template=None, tokenizer_config=dict(_QWEN_CONFIG),
        template="Qwen-Qwen3-0.6B.jinja", template_in="jinja",
        config={"bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>"},
        generation={"bos_token_id": "<|endoftext|>", "do_sample": True,
                    "eos_token_id": ["<|im_end|>", "<|endoftext|>"],
                    "pad_token_id": "<|endoftext|>", "temperature": 0.6, "top_k": 20,
                    "top_p": 0.95},
        model="qwen3"),
    "mistral-v0.3-instruct": Family(
        pipeline="mistral", added=_added(MISTRAL_SPECIALS), added_first=True, bos_template="<s>",
        tokenizer_config={"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
                          "clean_up_tokenization_spaces": False, "eos_token": "</s>",
                          "legacy": False, "model_max_length": _SP_MAX, "pad_token": None,
                          "sp_model_kwargs": {}, "spaces_between_special_tokens": False,
                          "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>",
                          "use_default_system_prompt": False},
        template="mistralai-Mistral-7B-Instruct-v0.3.jinja",
        special_tokens_map={"bos_token": _map_token("<s>"), "eos_token": _map_token("</s>"),
                            "unk_token": _map_token("<unk>")},
        config={"bos_token_id": "<s>", "eos_token_id": "</s>"},
        generation={"bos_token_id": "<s>", "eos_token_id": "</s>"},
        model="mistral"),
    "gemma3-it": Family(
        pipeline="gemma", added=_added(GEMMA_SPECIALS), added_first=True, bos_template="<bos>",
        tokenizer_config={"add_bos_token": True, "add_eos_token": False,
                          "boi_token": "<start_of_image>", "bos_token": "<bos>",
                          "clean_up_tokenization_spaces": False, "eoi_token": "<end_of_image>",
                          "eos_token": "<eos>", "extra_special_tokens": {
                              "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
                          "image_token": "<image_soft_token>", "model_max_length": _SP_MAX,
                          "pad_token": "<pad>", "sp_model_kwargs": None,
                          "spaces_between_special_tokens": False,
                          "tokenizer_class": "GemmaTokenizer", "unk_token": "<unk>",
                          "use_default_system_prompt": False},
        template="google-gemma-3-it.jinja",
        special_tokens_map={"boi_token": "<start_of_image>", "bos_token": _map_token("<bos>"),
                            "eoi_token": "<end_of_image>", "eos_token": _map_token("<eos>"),
                            "image_token": "<image_soft_token>", "pad_token": _map_token("<pad>"),
                            "unk_token": _map_token("<unk>")},
        config={"bos_token_id": "<bos>", "eos_token_id": ["<eos>", "<end_of_turn>"],
                "pad_token_id": "<pad>"},
        generation={"bos_token_id": "<bos>", "cache_implementation": "hybrid",
                    "do_sample": True, "eos_token_id": ["<eos>", "<end_of_turn>"],
                    "pad_token_id": "<pad>", "top_k": 64, "top_p": 0.95},
        model="gemma3", ordinary=("<s>", "</s>")),
    "smollm2-instruct": Family(
        pipeline="gpt2", added=_added(SMOLLM2_SPECIALS), added_first=True, bos_template=None,
        tokenizer_config={"add_prefix_space": False,
                          "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                          "bos_token": "<|im_start|>", "clean_up_tokenization_spaces": False,
                          "eos_token": "<|im_end|>", "model_max_length": 8192,
                          "pad_token": "<|im_end|>", "tokenizer_class": "GPT2Tokenizer",
                          "unk_token": "<|endoftext|>", "vocab_size": 49152},
        template="HuggingFaceTB-SmolLM2-135M-Instruct.jinja",
        special_tokens_map={"additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                            "bos_token": _map_token("<|im_start|>"),
                            "eos_token": _map_token("<|im_end|>"),
                            "pad_token": _map_token("<|im_end|>"),
                            "unk_token": _map_token("<|endoftext|>")},
        config={"bos_token_id": "<|im_start|>", "eos_token_id": "<|im_end|>"},
        generation={"bos_token_id": "<|im_start|>", "eos_token_id": "<|im_end|>",
                    "pad_token_id": "<|im_end|>"},
        model="smollm2"),
    BARE: Family(pipeline="llama3", added=_added(BARE_SPECIALS), added_first=False,
                 bos_template="<|doc|>", tokenizer_config={}, template=None),
}


# ----------------------------------------------------------------------------- tokenizer.json

def _byte_tokens():
    return [f"<0x{b:02X}>" for b in range(256)]


def _build_tokenizer(fam: Family, text: str):
    """The family's tokenizers.Tokenizer, trained on `text`, with its added tokens and
    post-processor."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, processors, trainers)

    first = [c for c, _ in fam.added] if fam.added_first else []
    lines = text.split("\n")
    if fam.pipeline in ("llama3", "qwen", "gpt2"):
        tok = Tokenizer(models.BPE())
        if fam.pipeline == "gpt2":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                         trim_offsets=True, use_regex=True)
        else:
            split = LLAMA3_SPLIT if fam.pipeline == "llama3" else QWEN_SPLIT
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False,
                                         trim_offsets=fam.pipeline == "llama3", use_regex=False)])
        if fam.pipeline == "qwen":
            tok.normalizer = normalizers.NFC()
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator([text], trainers.BpeTrainer(
            vocab_size=fam.vocab_size, special_tokens=first, show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    else:  # SentencePiece-style BPE with byte fallback (Mistral's Metaspace, Gemma's split)
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        if fam.pipeline == "mistral":
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                         split=False)
            tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                             decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        else:
            tok.normalizer = normalizers.Replace(" ", "▁")
            tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous",
                                                     invert=False)
            tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                             decoders.Fuse()])
        # the byte pieces <0x00>..<0xFF> follow the control tokens, as in the published files;
        # trained as special tokens to get those ids, then made ordinary vocabulary below
        tok.train_from_iterator(lines, trainers.BpeTrainer(
            vocab_size=fam.vocab_size + 256, special_tokens=first + _byte_tokens(),
            show_progress=False))
        d = json.loads(tok.to_str())
        bytes_ = set(_byte_tokens())
        d["added_tokens"] = [t for t in d["added_tokens"] if t["content"] not in bytes_]
        d["model"].update(unk_token="<unk>", fuse_unk=True, byte_fallback=True)
        vocab = d["model"]["vocab"]
        for piece in fam.ordinary:  # ordinary pieces named like other families' specials
            vocab.setdefault(piece, len(vocab))
        tok = Tokenizer.from_str(json.dumps(d))
    for content, special in fam.added:
        if content in first:
            continue
        token = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    if fam.pipeline in ("qwen", "gpt2"):
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                  use_regex=False)
    elif fam.bos_template is not None:
        bos = fam.bos_template
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
            special_tokens=[(bos, tok.token_to_id(bos))])
        tok.post_processor = (processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                                   template])
                              if fam.pipeline == "llama3" else template)
    return tok


# ----------------------------------------------------------------------------- the directory

@dataclass(frozen=True)
class LayoutInfo:
    """What write_layout wrote: the directory, and the published facts as token ids."""

    name: str
    directory: Path
    tokenizer_path: Path
    ids: dict                  # token string -> id, for the family's added tokens
    vocab_size: int            # the tokenizer's, with the added tokens
    model_vocab_size: int      # config.json's (covers the tokenizer)
    bos_token: str | None      # tokenizer_config.json's
    eos_token: str | None
    pad_token: str | None
    adds_bos: bool             # the tokenizer puts a BOS before a text
    stop_ids: frozenset        # generation_config.json's eos_token_id
    template: Path | None      # where the chat template was written (None: no template)

    def id(self, token):
        return None if token is None else self.ids[token]


def _ids_of(value, tok):
    if isinstance(value, list):
        return [_ids_of(v, tok) for v in value]
    if isinstance(value, str):
        idx = tok.token_to_id(value)
        assert idx is not None, value
        return idx
    return value


def _model_config(kind: str, vocab: int, token_ids: dict):
    """A tiny transformers config of the family (its class and published structure)."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  **token_ids)
    if kind == "llama3":
        return transformers.LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                        rope_theta=500000.0, rope_scaling=dict(
                                            rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0,
                                            original_max_position_embeddings=1024))
    if kind == "smollm2":
        return transformers.LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                        rope_theta=100000.0)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                        rope_theta=1000000.0, use_sliding_window=False)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16, rms_norm_eps=1e-6,
                                        tie_word_embeddings=True, rope_theta=1000000.0)
    if kind == "mistral":
        return transformers.MistralConfig(**common, rms_norm_eps=1e-5,
                                          tie_word_embeddings=False, rope_theta=1000000.0,
                                          sliding_window=None)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(**common, head_dim=16, rms_norm_eps=1e-6,
                                             query_pre_attn_scalar=16, sliding_window=512,
                                             rope_theta=1000000.0, rope_local_base_freq=10000.0)
    raise ValueError(kind)


def write_layout(name: str, directory, with_weights: bool = False) -> LayoutInfo:
    """Write the layout `name` (LAYOUTS or BARE) into `directory`; see the module docstring.
    with_weights: also random weights saved by transformers' own model class (needs torch)."""
    pytest.importorskip("tokenizers")
    fam = FAMILIES[name]
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(fam, training_text())
    tok.save(str(d / "tokenizer.json"))
    ids = {c: tok.token_to_id(c) for c, _ in fam.added}
    vocab = tok.get_vocab_size(with_added_tokens=True)
    model_vocab = int(math.ceil(vocab / 64) * 64)  # padded, as the published models are
    info = dict(name=name, directory=d, tokenizer_path=d / "tokenizer.json", ids=ids,
                vocab_size=vocab, model_vocab_size=model_vocab,
                adds_bos=fam.bos_template is not None, template=None)
    if name == BARE:
        return LayoutInfo(**info, bos_token=None, eos_token=None, pad_token=None,
                          stop_ids=frozenset())

    config = dict(fam.tokenizer_config)
    config["added_tokens_decoder"] = {
        str(ids[c]): {**_map_token(c), "special": special} for c, special in fam.added}
    template = (TEMPLATES / fam.template).read_text(encoding="utf-8")
    if fam.template_in == "jinja":
        (d / "chat_template.jinja").write_text(template, encoding="utf-8")
        info["template"] = d / "chat_template.jinja"
    else:
        config["chat_template"] = template
        info["template"] = d / "tokenizer_config.json"
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    if fam.special_tokens_map is not None:
        (d / "special_tokens_map.json").write_text(json.dumps(fam.special_tokens_map, indent=2))

    token_ids = {k: _ids_of(v, tok) for k, v in fam.config.items()}
    model_config = _model_config(fam.model, model_vocab, token_ids)
    if with_weights:
        import torch
        import transformers

        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(model_config)
        model.save_pretrained(d)
    else:
        model_config.save_pretrained(d)
    generation = {k: _ids_of(v, tok) if k.endswith("token_id") else v
                  for k, v in fam.generation.items()}
    (d / "generation_config.json").write_text(json.dumps(generation, indent=2))
    stop = generation.get("eos_token_id")
    return LayoutInfo(**info, bos_token=config.get("bos_token"),
                      eos_token=config.get("eos_token"), pad_token=config.get("pad_token"),
                      stop_ids=frozenset(stop if isinstance(stop, list) else [stop]))
