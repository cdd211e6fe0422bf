"""RunConfig's `sample` section: text sampled at the end of a run and by `jaxmem.generate`.

Re-exported from jaxmem.config.run (`from jaxmem.config.run import SampleSection` still works).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxmem.config.fields import option


@dataclass(frozen=True)
class SampleSection:
    """Text sampled from the model: at the end of a run, and by `jaxmem.generate`."""

    prompt: str | None = option(None, "text to continue (default: the end-of-training sample "
                                "continues the first line of the eval data; jaxmem.generate the "
                                "run's --prompt, else it samples from BOS alone)")
    max_new_tokens: int = option(200, "tokens to generate (0: none at the end of a run)",
                                 flags=("--max-new-tokens", "--sample-tokens"), type="nonneg_int",
                                 mutable=True)
    temperature: float = option(0.8, "sampling temperature (0: greedy)", type="nonneg_float",
                                mutable=True)
    top_k: int = option(40, "sample among the K most likely tokens (0: all)", type="nonneg_int",
                        mutable=True)
    stop: str | None = option(None, "end the text before this string (also at the tokenizer's "
                              "EOS ids and generation_config.json's)", metavar="STRING",
                              flags=("--stop", "--sample-stop"),
                              mutable=True)
    dtype: str | None = option(None, "compute and KV-cache dtype of sampling (default: bfloat16 "
                               "on a GPU, float16 for an amp-fp16 run; on CPU the run's compute "
                               "dtype, float32 for --hf)", flags=("--dtype", "--sample-dtype"),
                               choices=["float32", "bfloat16", "float16"], mutable=True)
