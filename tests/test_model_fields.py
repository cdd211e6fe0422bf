"""One list of model fields: ModelConfig's own. Every field is recorded in a run's config.json
and read back, and `--init-from` restores every field of the checkpoint's config (issue 53)."""

import dataclasses
import json

import pytest

from jaxmem.config.run import ModelSection, RunConfig
from jaxmem.families import PRESETS
from jaxmem.families.config import ModelConfig
from jaxmem.train.init_from import init_from_overrides

FIELDS = [f.name for f in dataclasses.fields(ModelConfig)]


def test_the_model_section_is_modelconfig_fields():
    names = [f.name for f in dataclasses.fields(ModelSection)]
    assert names[0] == "preset" and sorted(names[1:]) == sorted(FIELDS)


@pytest.mark.parametrize("preset", ["tiny", "gemma-3-1b", "qwen2.5-0.5b", "llama-3.2-1b"])
def test_config_json_records_and_restores_every_field(preset):
    model = PRESETS[preset]
    run = RunConfig(model=ModelSection.of(model))
    written = json.loads(json.dumps(run.to_dict()))
    assert set(FIELDS) <= set(written["model"])
    # every field as the value a run records: what differs from the tiny preset is written
    changed = {f for f in FIELDS if getattr(model, f) != getattr(PRESETS["tiny"], f)}
    assert {f for f in FIELDS if written["model"][f] is not None} == changed
    assert RunConfig.from_dict(written).model_config() == model


def _gemma_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
        max_position_embeddings=128)
    cfg.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")  # only its presence is asked here
    return tmp_path


def test_init_from_restores_every_field(tmp_path):
    from jaxmem.io.hf import config_from_hf, read_hf_config

    hf_dir = _gemma_checkpoint(tmp_path)
    overrides = init_from_overrides({"init.init_from": str(hf_dir)})
    assert {f"model.{f}" for f in FIELDS} <= set(overrides)
    expected = config_from_hf(read_hf_config(str(hf_dir)))
    assert RunConfig().replace(overrides).model_config() == expected
    assert expected != PRESETS["tiny"].replace(family="gemma3")  # it is not the default shape
