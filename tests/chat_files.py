"""A tiny Llama-3-style tokenizer directory with a real chat template, for the chat tests
(imported by name, like hf_files.py)."""

import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]
TEMPLATES = {"llama3": DATA / "llama3_chat_template.jinja",
             "llama3.2": DATA / "llama3.2_chat_template.jinja",
             "generation": DATA / "llama3_generation_chat_template.jinja"}
CHAT_FILE = DATA / "chat_tiny.jsonl"

CONVERSATIONS = [
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "user", "content": "Say hello."},
     {"role": "assistant", "content": "  Hello!  "}],  # trimmed by the template
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "How many legs does a cat have?"},
     {"role": "assistant", "content": "Four."},
     {"role": "user", "content": "And a bird?"},
     {"role": "assistant", "content": "Two.\n\nBirds walk on two legs."}],
    [{"role": "user", "content": "héllo wörld — 日本語?"},
     {"role": "assistant", "content": "Ünïcode ok."},
     {"role": "user", "content": "What color is the sky?"},
     {"role": "assistant", "content": "Blue."}],
]


def tokenizer_text() -> str:
    return " ".join(m["content"] for c in CONVERSATIONS for m in c) + " " + \
        CHAT_FILE.read_text() * 2 + " system user assistant Cutting Knowledge Date Today"


def write_chat_tokenizer(d, template: str = "llama3.2", where: str = "config",
                         vocab_size: int = 400) -> Path:
    """tokenizer.json (byte-level BPE, Llama 3's special tokens, BOS added by the
    post-processor) and tokenizer_config.json in `d`; the chat template goes into
    tokenizer_config.json (where="config"), chat_template.jinja ("jinja") or nowhere (None)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([tokenizer_text()], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = tok.token_to_id(SPECIALS[0])
    tok.post_processor = processors.TemplateProcessing(single=f"{SPECIALS[0]} $A",
                                                       special_tokens=[(SPECIALS[0], bos)])
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0],
              "eos_token": "<|eot_id|>", "model_max_length": 4096, "clean_up_tokenization_spaces": False}
    text = TEMPLATES[template].read_text() if template else None
    if where == "config" and text:
        config["chat_template"] = text
    elif where == "jinja" and text:
        (d / "chat_template.jinja").write_text(text)
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return d / "tokenizer.json"
