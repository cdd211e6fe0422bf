"""Qwen2 and Qwen2.5 dense (0.5B to 72B): biases on the q, k and v projections, tied embeddings
in the small sizes. Their checkpoints name a sliding window but leave it off
(`use_sliding_window: false`); one that turns it on is refused."""

from jaxmem.families.base import Family, refuse, register


def _fields(d: dict) -> dict:
    refuse(d, "use_sliding_window", lambda v: v is False,
           "sliding-window attention is not built for qwen2")
    refuse(d, "layer_types", lambda v: set(v) <= {"full_attention"},
           "every layer full attention only")
    return {"qkv_bias": True}


QWEN2 = register(Family("qwen2", "Qwen2ForCausalLM", fields=_fields,
                        hf_keys=lambda c: {"use_sliding_window": False, "sliding_window": None,
                                           "max_window_layers": c.num_layers}))
