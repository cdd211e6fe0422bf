"""Host memory of reading a Hugging Face checkpoint: jaxmem.io.hf.load_hf vs load_file + convert.

    python -m experiments.tables.hf_load_memory [--hidden 1024 --layers 8 --dir /tmp/hf_mem]

Writes a random bf16 Llama checkpoint (sharded, jaxmem.io.hf_export.save_hf), then in a fresh
process per reader measures the peak resident set (ru_maxrss) added by reading it as fp32 params.
One host copy of the model in fp32 is the floor; `load_file` first holds every bf16 tensor and
then the converted fp32 ones, so it needs the file's size more. The peak is read from
/proc/self/status (VmHWM), which counts the memory-mapped pages safetensors reads through.

Measured (2-core shared CPU, 2026-11-22): 187M params, 357 MiB bf16 in 64 MiB shards, 714 MiB of
fp32 params: load_hf peak +784 to +804 MiB (1.10-1.13x: one copy plus the largest tensor and
its fp32 conversion); load_file + convert +1071 MiB (1.50x). Before load_hf closed each file
after each tensor, its open memory maps kept every page read resident: +1170 MiB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

READ = r"""
import sys, json, numpy as np
from jaxmem.io.hf import load_hf, read_hf_config, config_from_hf
from jaxmem.io.hf_names import params_from_hf
import ml_dtypes, safetensors.numpy, glob
hf_dir, how = sys.argv[1], sys.argv[2]
config = config_from_hf(read_hf_config(hf_dir))
def hwm_kib():
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
before = hwm_kib()
if how == "load_hf":
    _, params = load_hf(hf_dir, np.float32)
else:  # every tensor in memory first, then the conversion
    state = {}
    for f in sorted(glob.glob(hf_dir + "/*.safetensors")):
        state.update(safetensors.numpy.load_file(f))
    params = params_from_hf(config, state.__getitem__, np.float32)
after = hwm_kib()
n = sum(x.nbytes for x in __import__("jax").tree_util.tree_leaves(params))
print(json.dumps({"how": how, "peak_added_mib": (after - before) / 1024, "params_mib": n / 2**20}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.tables.hf_load_memory")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dir", default="/tmp/jaxmem_hf_mem")
    args = p.parse_args(argv)

    import numpy as np

    from jaxmem.families.config import ModelConfig
    from jaxmem.io.hf_export import save_hf
    from jaxmem.families.params import abstract_params, num_params

    import jax

    d = args.hidden
    config = ModelConfig(vocab_size=32000, hidden_size=d, intermediate_size=4 * d,
                         num_layers=args.layers, num_heads=d // 64, num_kv_heads=d // 256)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(lambda s: rng.standard_normal(s.shape, np.float32),
                                    abstract_params(config))
    shutil.rmtree(args.dir, ignore_errors=True)  # a scratch directory of this script
    save_hf(args.dir, config, params, dtype="bfloat16", max_shard_bytes=64 << 20)
    del params
    file_mib = sum(f.stat().st_size for f in __import__("pathlib").Path(args.dir).glob(
        "*.safetensors")) / 2**20
    print(f"checkpoint: {num_params(config):,} params, {file_mib:.0f} MiB bf16 on disk")
    for how in ("load_hf", "load_file"):
        out = subprocess.run([sys.executable, "-c", READ, args.dir, how], capture_output=True,
                             text=True, check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        print(f"{how:9s}: peak added {r['peak_added_mib']:.0f} MiB for {r['params_mib']:.0f} MiB "
              f"of fp32 params ({r['peak_added_mib'] / r['params_mib']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
