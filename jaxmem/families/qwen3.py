"""Qwen3 dense (0.6B to 32B): an RMSNorm over the head dim on q and k before RoPE, an explicit
head dim, tied embeddings in the small sizes. Its checkpoints name the sliding window but leave
it off (`use_sliding_window: false`); one that turns it on is refused."""

from jaxmem.families.base import Family, refuse, register


def _fields(d: dict) -> dict:
    refuse(d, "use_sliding_window", lambda v: v is False,
           "sliding-window attention is not built for qwen3")
    refuse(d, "layer_types", lambda v: set(v) <= {"full_attention"},
           "every layer full attention only")
    return {"qk_norm": True}


QWEN3 = register(Family("qwen3", "Qwen3ForCausalLM", fields=_fields,
                        hf_keys=lambda c: {"use_sliding_window": False, "sliding_window": None,
                                           "max_window_layers": c.num_layers}))
