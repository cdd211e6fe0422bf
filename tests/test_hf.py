"""Hugging Face files without torch: the config mapping, jaxmem's own export read back, the
tokenizer's special tokens, and bad checkpoint directories (exit 2, one line naming the problem).

Parity with transformers itself is tests/test_hf_parity.py (needs torch + transformers).
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.families import PRESETS
from jaxmem.io.hf import HFError, config_from_hf, config_to_hf, load_hf
from jaxmem.io.hf_export import save_hf
from jaxmem.families.decoder import Decoder

from hf_files import random_params, write_tokenizer  # noqa: E402
from numerics import assert_reordered_fp32  # noqa: E402

# config.json of the real checkpoints (transformers 4.x spelling), as published on the Hub.
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256}
LLAMA_32_3B = {**LLAMA_32_1B, "head_dim": 128, "hidden_size": 3072, "num_attention_heads": 24,
               "num_hidden_layers": 28}
LLAMA_3_8B = {**LLAMA_32_1B, "hidden_size": 4096, "intermediate_size": 14336,
              "max_position_embeddings": 8192, "num_hidden_layers": 32, "rope_scaling": None,
              "tie_word_embeddings": False, "head_dim": None}
# Llama 3.1's config.json files (8B, 70B, 405B): rope_scaling factor 8, 131k positions, untied.
LLAMA_31_8B = {**LLAMA_32_1B, "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "tie_word_embeddings": False, "head_dim": None,
               "rope_scaling": {**LLAMA_32_1B["rope_scaling"], "factor": 8.0}}
LLAMA_31_70B = {**LLAMA_31_8B, "hidden_size": 8192, "intermediate_size": 28672,
                "num_attention_heads": 64, "num_hidden_layers": 80}
LLAMA_31_405B = {**LLAMA_31_8B, "hidden_size": 16384, "intermediate_size": 53248,
                 "num_attention_heads": 128, "num_hidden_layers": 126}
LLAMA_2_7B = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
              "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
              "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
              "torch_dtype": "float16", "vocab_size": 32000}


# microsoft/Phi-4-mini-instruct's config.json (its LongRoPE factors shortened here: 48 each)
PHI_4_MINI = {"architectures": ["Phi3ForCausalLM"], "attention_bias": False,
              "attention_dropout": 0.0, "bos_token_id": 199999, "embd_pdrop": 0.0,
              "eos_token_id": 199999, "full_attn_mod": 1, "hidden_act": "silu",
              "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
              "interpolate_factor": 1, "lm_head_bias": False, "max_position_embeddings": 131072,
              "mlp_bias": False, "model_type": "phi3", "num_attention_heads": 24,
              "num_hidden_layers": 32, "num_key_value_heads": 8,
              "original_max_position_embeddings": 4096, "pad_token_id": 199999,
              "partial_rotary_factor": 0.75, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
              "rope_scaling": {"long_factor": [1.0] * 48, "short_factor": [1.0] * 48,
                               "type": "longrope"},
              "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16", "vocab_size": 200064}


def resolved(c):
    return c.replace(head_dim=c.resolved_head_dim)


def test_phi_4_mini_is_its_config_json_without_longrope():
    """Its LongRoPE is refused by key; without it (at the original 4096 positions) the config.json
    is the preset: 96 of 128 head dims rotated, the 262144 window read as none."""
    with pytest.raises(HFError, match=r"^config.json: rope_scaling.rope_type='longrope' is not "):
        config_from_hf(PHI_4_MINI)
    plain = {**PHI_4_MINI, "rope_scaling": None, "max_position_embeddings": 4096}
    c = config_from_hf(plain)
    assert resolved(c) == resolved(PRESETS["phi-4-mini"]) and c.rotary_dim == 96
    assert c.sliding_window is None
    assert resolved(config_from_hf(config_to_hf(c))) == resolved(c)
    with pytest.raises(HFError, match=r"^config.json: sliding_window=2047 is not supported"):
        config_from_hf({**plain, "sliding_window": 2047})  # Phi-3-mini-4k's
    with pytest.raises(HFError, match=r"^config.json: lm_head_bias=true is not supported"):
        config_from_hf({**plain, "lm_head_bias": True})
    with pytest.raises(HFError, match=r"partial_rotary_factor=0\.7 "):  # 89.6 dims
        config_from_hf({**plain, "partial_rotary_factor": 0.7})


@pytest.mark.parametrize("name, hf", [("llama-3.2-1b", LLAMA_32_1B), ("llama-3.2-3b", LLAMA_32_3B),
                                      ("llama-3-8b", LLAMA_3_8B), ("llama-2-7b", LLAMA_2_7B),
                                      ("llama-3.1-8b", LLAMA_31_8B), ("llama-3.1-70b", LLAMA_31_70B),
                                      ("llama-3.1-405b", LLAMA_31_405B)])
def test_presets_equal_the_published_configs(name, hf):
    assert resolved(config_from_hf(hf)) == resolved(PRESETS[name])
    assert resolved(config_from_hf(config_to_hf(PRESETS[name]))) == resolved(PRESETS[name])


def test_transformers_5_spelling_reads_the_same():
    new = {k: v for k, v in LLAMA_32_1B.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")}
    new["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA_32_1B["rope_scaling"]}
    new["dtype"] = "bfloat16"
    assert config_from_hf(new) == config_from_hf(LLAMA_32_1B)
    classic_type = {**LLAMA_32_1B, "rope_scaling": {**LLAMA_32_1B["rope_scaling"], "type": "llama3"}}
    del classic_type["rope_scaling"]["rope_type"]  # the oldest spelling: "type"
    assert config_from_hf(classic_type) == config_from_hf(LLAMA_32_1B)


@pytest.mark.parametrize("change, needle", [
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"model_type": "gemma2"}, "model_type='gemma2' is not supported (families: gemma3, llama, "),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters.rope_type='dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act=\"gelu\" is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported (RoPE on the "
                                     "whole head only for llama)"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5 is not supported"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quantization_config (quant_method 'gptq') is not supported"),
])
def test_unsupported_keys_are_named(change, needle):
    with pytest.raises(HFError, match=None) as e:
        config_from_hf({**LLAMA_32_1B, **change})
    assert needle in str(e.value) and "\n" not in str(e.value)


CFG = PRESETS["tiny"].replace(vocab_size=300, hidden_size=48, intermediate_size=80, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                              max_position_embeddings=4096, rope_type="llama3", rope_factor=8.0,
                              rope_original_max_position_embeddings=256)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A jaxmem-written HF directory (sharded, bf16 and fp32 variants) with a tokenizer."""
    d = tmp_path_factory.mktemp("hf")
    write_tokenizer(d / "tok", "hello world, the quick brown fox " * 50)
    params = random_params(CFG)
    save_hf(d / "fp32", CFG, params, max_shard_bytes=40_000, tokenizer=str(d / "tok" / "tokenizer.json"),
            bos_token_id=0, eos_token_id=1)
    save_hf(d / "bf16", CFG, params, dtype="bfloat16")
    return d, params


def test_export_reads_back(exported):
    d, params = exported
    assert len(list((d / "fp32").glob("model-*-of-*.safetensors"))) > 1
    assert (d / "fp32" / "model.safetensors.index.json").exists()
    c, back = load_hf(d / "fp32")
    assert c == CFG
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)
    c16, back16 = load_hf(d / "bf16")  # bf16 on disk, read as fp32: the bf16 rounding only
    for a, b in zip(jax.tree_util.tree_leaves(back16), jax.tree_util.tree_leaves(params)):
        np.testing.assert_allclose(a, b, rtol=2 ** -8, atol=0)
    assert json.loads((d / "fp32" / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"


def test_tokenizer_adds_bos_as_its_post_processor_does(exported):
    pytest.importorskip("tokenizers")
    from jaxmem.io.hf import hf_tokenizer

    d, _ = exported
    tok = hf_tokenizer(d / "fp32")
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    ids = tok.encode_prompt("hello world")
    assert ids[0] == 0 and ids[1:] == tok.encode("hello world")
    assert tok.decode(ids) == "hello world"


def _generate(argv, capsys):
    from jaxmem.generate.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    lines = [l for l in capsys.readouterr().err.splitlines()
             if l.startswith("python -m jaxmem.generate: error: ")]
    assert len(lines) == 1
    return lines[0]


def _broken(d, tmp_path, how):
    out = tmp_path / how
    shutil.copytree(d / "fp32", out)
    index = out / "model.safetensors.index.json"
    if how == "no_config":
        (out / "config.json").unlink()
    elif how == "no_weights":
        for f in out.glob("*.safetensors*"):
            f.unlink()
    elif how == "missing_shard":
        shard = sorted(out.glob("model-*.safetensors"))[1]
        shard.unlink()
        return out, shard.name
    elif how == "wrong_shape":
        from safetensors.numpy import load_file, save_file

        weight_map = json.loads(index.read_text())["weight_map"]
        name = "model.layers.1.mlp.down_proj.weight"
        tensors = load_file(out / weight_map[name])
        tensors[name] = tensors[name][:, :-1].copy()
        save_file(tensors, str(out / weight_map[name]), metadata={"format": "pt"})
        return out, f"tensor {name} has shape (48, 79), expected (48, 80)"
    elif how == "bias":
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
        return out, "attention_bias=true is not supported"
    return out, {"no_config": "no config.json", "no_weights": "no model.safetensors"}[how]


@pytest.mark.parametrize("how", ["no_config", "no_weights", "missing_shard", "wrong_shape", "bias"])
def test_bad_checkpoint_dirs_exit_2_with_one_line(exported, tmp_path, capsys, how):
    d, _ = exported
    bad, needle = _broken(d, tmp_path, how)
    err = _generate(["--hf", str(bad), "--max-new-tokens", "2"], capsys)
    assert needle in err, err
    if how == "missing_shard":
        assert "names shard" in err


@pytest.mark.slow  # 9.4 s cold on 2 cores (default run kept under 5 min)
def test_generate_hf_greedy_matches_argmax(exported, capsys):
    pytest.importorskip("tokenizers")
    from jaxmem.generate.cli import main
    from jaxmem.io.hf import hf_tokenizer

    d, params = exported
    assert main(["--hf", str(d / "fp32"), "--prompt", "hello", "--temperature", "0",
                 "--max-new-tokens", "4", "--dtype", "float32"]) == 0  # GPU default: bf16
    text = capsys.readouterr().out.strip("\n")
    tok = hf_tokenizer(d / "fp32")
    ids = tok.encode_prompt("hello")
    for _ in range(4):  # greedy by hand: argmax of the last position, no cache
        logits = Decoder(CFG).apply({"params": params}, jnp.asarray([ids]))
        ids.append(int(jnp.argmax(logits[0, -1])))
    assert text == tok.decode(ids)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "amp-bf16", "amp-fp16", "fp8"])
@pytest.mark.slow  # 14.9 s cold on 2 cores (default run kept under 5 min)
def test_init_from_weights_start_the_state_in_every_precision_mode(exported, mode):
    """Step 0's params are the checkpoint's, cast to the mode's storage dtype (bitwise), and the
    first step's loss is the checkpoint model's loss (fp32: 1e-6; other modes: 2e-2)."""
    from jaxmem.config.run import RunConfig
    from jaxmem.train.init_from import init_from_overrides, init_params_from
    from jaxmem.train.loss import synthetic_batch, token_loss
    from jaxmem.model.precision import cast_floating
    from jaxmem.train.run import build_step_config
    from jaxmem.train.step import create_train_state, jit_train_step

    d, params = exported
    overrides = init_from_overrides({"init.init_from": str(d / "fp32"), "precision.mode": mode})
    assert overrides["data.tokenizer"] == str((d / "fp32" / "tokenizer.json").resolve())
    cfg = RunConfig().replace(overrides)
    model_cfg, step_cfg, loss_scale = build_step_config(cfg)
    assert model_cfg == CFG
    loaded = init_params_from(cfg.init.init_from, model_cfg, step_cfg.precision.param_dtype)
    state = create_train_state(step_cfg, loss_scale, params=loaded)
    want = cast_floating(params, step_cfg.precision.param_dtype)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                           state.params, want)
    batch = synthetic_batch(jax.random.PRNGKey(0), 2, 16, CFG.vocab_size)
    total, count = token_loss(Decoder(CFG), params, batch, False, jnp.float32)
    _, metrics = jit_train_step(step_cfg)(state, jax.tree_util.tree_map(lambda x: x[None], batch))
    if mode == "fp32":  # the jitted train step vs the eager loss: tests/numerics.py
        assert_reordered_fp32(metrics["loss"], total / count)
    else:
        np.testing.assert_allclose(float(metrics["loss"]), float(total / count), rtol=2e-2)


@pytest.mark.parametrize("argv, needle", [
    (["--init-from", "{d}/nothing"], "nothing: not a directory"),
    (["--init-from", "{d}/bf16"], "no tokenizer.json"),
    (["--init-from", "{d}/fp32", "--preset", "small"], "--preset cannot be given with --init-from"),
    (["--init-from", "{d}/fp32", "--tokenizer", "{d}/fp32/tokenizer.json"],
     "--tokenizer cannot be given with --init-from"),
])
def test_train_init_from_bad_input_exits_2(exported, tmp_path, capsys, argv, needle):
    from jaxmem.train.cli import main

    from runs import error_line  # noqa: PLC0415

    d, _ = exported
    with pytest.raises(SystemExit) as e:
        main([a.replace("{d}", str(d)) for a in argv] + ["--out", str(tmp_path / "run")])
    assert e.value.code == 2
    assert needle in error_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_train_init_from_a_broken_checkpoint_exits_2_before_training(exported, tmp_path, capsys,
                                                                     corpus):
    from jaxmem.train.cli import main

    from runs import error_line  # noqa: PLC0415

    d, _ = exported
    bad, needle = _broken(d, tmp_path, "missing_shard")
    with pytest.raises(SystemExit) as e:
        main(["--init-from", str(bad), "--data", corpus, "--out", str(tmp_path / "run")])
    assert e.value.code == 2
    assert needle in error_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_export_bad_input_exits_2(exported, tmp_path, capsys):
    from jaxmem.export.cli import main

    d, _ = exported
    for argv, needle in [(["--run", str(tmp_path / "none"), "--out", str(tmp_path / "x")],
                          "no run config"),
                         (["--run", str(tmp_path), "--out", str(d / "fp32"), "--max-shard-mb", "0"],
                          "--max-shard-mb must be > 0")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = [l for l in capsys.readouterr().err.splitlines()
               if l.startswith("python -m jaxmem.export: error: ")]
        assert len(err) == 1 and needle in err[0], err


def test_save_hf_refuses_a_directory_holding_a_checkpoint(exported):
    d, params = exported
    before = sorted(p.name for p in (d / "bf16").iterdir())
    with pytest.raises(HFError, match="already holds a checkpoint"):
        save_hf(d / "bf16", CFG, params)
    assert sorted(p.name for p in (d / "bf16").iterdir()) == before


@pytest.mark.slow  # three CLI runs
def test_init_from_run_resumes_bitwise_without_the_weights(exported, tmp_path, corpus):
    """An --init-from run stopped at step 1 and resumed (the checkpoint's weights deleted
    meanwhile) ends bitwise equal to an uninterrupted one: after step 0 the run reads only its
    own checkpoints, and the tokenizer.json its config names (as any --tokenizer run)."""
    from jaxmem.train.cli import main

    from runs import losses, params_of  # noqa: PLC0415

    d, _ = exported
    src = tmp_path / "ckpt"
    shutil.copytree(d / "fp32", src)
    common = ["--init-from", str(src), "--data", corpus, "--steps", "3", "--batch-size", "2",
              "--seq-len", "16", "--sample-tokens", "0", "--no-progress", "--log-every", "1",
              "--eval-batches", "1"]
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    assert main([*common, "--out", str(tmp_path / "split"), "--stop-at", "1"]) == 0
    for f in [*src.glob("*.safetensors"), src / "model.safetensors.index.json"]:
        f.unlink()
    assert main(["--out", str(tmp_path / "split"), "--resume", "--no-progress"]) == 0
    whole, split = params_of(tmp_path / "whole"), params_of(tmp_path / "split")
    assert whole[0] == split[0] == 3
    for a, b in zip(whole[1], split[1]):
        np.testing.assert_array_equal(a, b)
    assert losses(tmp_path / "whole") == losses(tmp_path / "split")
