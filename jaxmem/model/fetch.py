"""The decoder's layers read from host memory (`--offload-base host`, jaxmem.peft.offload; the
trained params under `--offload-params host`, in the in-backward step and in eval and sampling):
each layer's params copied to the device inside the layer scan, one layer at a time.

    fetching(block, remat)      the block reading its params through layer_to_device
    layer_to_device(params)     one layer's host-resident leaves copied to the device
"""

from __future__ import annotations

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

from jaxmem.model.remat import TAGS, RematPolicy
from jaxmem.optim import in_host_memory, to_device  # noqa: F401  (to_device re-exported)


def layer_to_device(layer_params):
    """One layer's params inside the layer scan, with every leaf kept in host memory copied to
    the device (`--offload-base host`, jaxmem.peft.offload). The copy is tagged "base_layer",
    which no remat policy saves: the backward fetches the layer again instead of keeping all L
    device copies."""
    def fetch(x):
        if not in_host_memory(x):
            return x
        return checkpoint_name(jax.device_put(x, jax.memory.Space.Device), "base_layer")
    return jax.tree_util.tree_map(fetch, layer_params)


def fetching(block, remat: RematPolicy):
    """`block` reading its params through layer_to_device. Under remat none the block is
    rematerialized keeping every tagged activation (remat.TAGS) and nothing else: saving all
    residuals would keep values computed from each fetched layer (its transposes, an NF4
    weight's leaves), i.e. L device copies of the base (seen in the CUDA lowering: fetches in
    the forward loop only, weight-shaped carries out of it)."""
    block = nn.map_variables(block, "params", trans_in_fn=layer_to_device, init=True)
    if not remat.enabled:
        policy = jax.checkpoint_policies.save_only_these_names(*TAGS)
        block = nn.remat(block, policy=policy, prevent_cse=False)
    return block
