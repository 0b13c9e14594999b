"""Config overlays: a model an overlay switches to another source keeps none of the old source's keys (said in a
note), ``key: null`` removes a key, a contradiction inside one file and a typo are still errors; the keys each
source reads are the schema's."""
import pytest
import yaml

from qerl.overlays import SOURCE_KEYS, settle_models
from qerl.workflow_config import ConfigFileError, SCHEMA, read_workflow_config

PAPER = "config/paper.yaml"


def test_the_source_keys_are_the_schemas():
    rules = yaml.safe_load(SCHEMA.read_text())["properties"]["models"]["additionalProperties"]["allOf"]
    props = set(yaml.safe_load(SCHEMA.read_text())["properties"]["models"]["additionalProperties"]["properties"])
    only = set().union(*SOURCE_KEYS.values())
    for rule in rules:
        cond = rule["if"]["properties"]["source"]
        sources = cond.get("enum") or [cond["const"]]
        refused = {r["required"][0] for r in rule["then"]["not"]["anyOf"]}
        for source in sources:
            assert refused == only - SOURCE_KEYS[source], source  # what a source refuses: the others' keys
            assert set(rule["then"].get("required", [])) <= SOURCE_KEYS[source]
    assert only <= props


def test_an_overlay_switches_a_hub_model_to_local_weights(tmp_path):
    (tmp_path / "local.yaml").write_text("models:\n  qwen2.5-7b: {source: local, path: /data/q7}\n"
                                         "  qwen2.5-3b: {revision: null}\n")
    notes = []
    with pytest.raises(ConfigFileError, match=r"qwen2.5-3b: 'revision' is a required property for source 'hub'"):
        read_workflow_config([PAPER, tmp_path / "local.yaml"], notes=notes)  # (null removed it: the hub needs it)
    (tmp_path / "local.yaml").write_text("models:\n  qwen2.5-7b: {source: local, path: /data/q7}\n")
    notes = []
    config = read_workflow_config([PAPER, tmp_path / "local.yaml"], notes=notes)
    assert config["models"]["qwen2.5-7b"] == {"source": "local", "path": "/data/q7", "paper_column": "7B"}
    assert notes == [f"models.qwen2.5-7b: source 'local' ({tmp_path / 'local.yaml'}) does not read hub_id, revision "
                     f"({PAPER}): dropped"]
    assert config["models"]["qwen2.5-3b"]["source"] == "hub"  # the others untouched


def test_a_contradiction_inside_one_file_and_a_typo_are_still_named(tmp_path):
    (tmp_path / "both.yaml").write_text("models:\n  qwen2.5-7b: {source: local, path: /x, hub_id: a/b}\n")
    with pytest.raises(ConfigFileError, match="hub_id is not read for source 'local'"):
        read_workflow_config([PAPER, tmp_path / "both.yaml"])
    (tmp_path / "typo.yaml").write_text("models:\n  qwen2.5-7b: {source: local, paht: /x}\n")
    with pytest.raises(ConfigFileError, match=r"unknown key 'models.qwen2.5-7b.paht' \(did you mean 'path'\?\)"):
        read_workflow_config([PAPER, tmp_path / "typo.yaml"])


def test_settle_models_on_a_merged_config_in_place():
    layers = [("a.yaml", {"models": {"m": {"source": "tiny", "seed": 3, "arch": "llama"}}}),
              ("b.yaml", {"models": {"m": {"source": "gguf", "path": "m.gguf", "scale_rule": None}}})]
    config = {"models": {"m": {"source": "gguf", "seed": 3, "arch": "llama", "path": "m.gguf", "scale_rule": None}}}
    notes = settle_models(config, layers)
    assert config["models"]["m"] == {"source": "gguf", "path": "m.gguf"}
    assert notes == ["models.m: source 'gguf' (b.yaml) does not read seed, arch (a.yaml): dropped"]
