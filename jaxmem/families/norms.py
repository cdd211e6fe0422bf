"""Where a decoder block's RMSNorms sit (ModelConfig.norm_placement): the one answer the block
(jaxmem.families.decoder), the HF tensor table (jaxmem.families.names), the saved-residuals
formula (jaxmem.families.residuals) and the in-backward step's MLP slabs ask, instead of each
testing a flag or matching a name.

    "pre"       Llama, Qwen, Mistral: input_layernorm before attention, post_attention_layernorm
                before the MLP
    "sandwich"  Gemma 3: input_layernorm before attention and post_attention_layernorm after
                it, pre_feedforward_layernorm before the MLP and post_feedforward_layernorm
                after it
    "post"      OLMo 2: no norm before attention or the MLP; post_attention_layernorm after
                attention, post_feedforward_layernorm after the MLP (each output normed before
                it joins the residual stream)

The names are the checkpoints' (model.layers.{i}.<name>.weight).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NormPlacement:
    """The norms of one block by where they sit (None: no norm there)."""

    name: str
    # the norm whose output feeds attention (its input is the residual stream)
    before_attention: str | None
    # the norm of attention's output, before it joins the residual stream
    after_attention: str | None
    # the norm whose output feeds the MLP
    before_mlp: str | None
    # the norm of the MLP's output, before it joins the residual stream
    after_mlp: str | None

    @property
    def names(self) -> tuple[str, ...]:
        """The block's norms in checkpoint order (the order the HF tensor table lists them)."""
        return tuple(n for n in (self.before_attention, self.after_attention, self.before_mlp,
                                 self.after_mlp) if n is not None)

    @property
    def post_norms(self) -> tuple[str, ...]:
        """The norms of a sublayer's output (after attention, after the MLP)."""
        return tuple(n for n in (self.after_attention, self.after_mlp) if n is not None)


PLACEMENTS = {p.name: p for p in (
    NormPlacement("pre", "input_layernorm", None, "post_attention_layernorm", None),
    NormPlacement("sandwich", "input_layernorm", "post_attention_layernorm",
                  "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    NormPlacement("post", None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
)}
