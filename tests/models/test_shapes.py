"""Model shapes from a transformers config.json: what the kernel benchmarks and the tuner take for any model."""
import json

import pytest

from qerl.models import shapes

# Gemma-2-2B's sizes: a family the tuned tables do not cover (head dim 256, hidden 2304)
GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "hidden_size": 2304, "intermediate_size": 9216,
          "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
          "vocab_size": 256000, "tie_word_embeddings": True}


def test_a_config_path_or_its_directory_gives_the_models_projections(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA2))
    for arg in (str(tmp_path), str(tmp_path / "config.json")):
        s = shapes.named(arg)
        assert (s.hidden, s.intermediate, s.layers, s.heads, s.kv_heads, s.head_dim, s.vocab, s.tied) == (
            2304, 9216, 26, 8, 4, 256, 256000, True)
        # (N, K) as the engine fuses them: q/k/v 8·256 + 2·4·256, o back to hidden, gate/up 2·I, down
        assert shapes.projections(arg) == {"qkv": (4096, 2304), "o": (2304, 2048), "gate_up": (18432, 2304),
                                           "down": (2304, 9216)}
        assert shapes.model_arg(arg) == arg
    assert shapes.named("7B") is shapes.QWEN25["7B"] and shapes.model_arg("llama-8B") == "llama-8B"
    # a multimodal config's text part
    (tmp_path / "vlm.json").write_text(json.dumps({"model_type": "x", "text_config": GEMMA2}))
    assert shapes.named(str(tmp_path / "vlm.json")).hidden == 2304


def test_bad_model_arguments_name_the_file_and_the_problem(tmp_path):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="not a named size .*7B.* and no config.json"):
        shapes.model_arg(str(tmp_path / "nowhere"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not a readable JSON config"):
        shapes.named(str(tmp_path / "broken.json"))
    (tmp_path / "partial.json").write_text(json.dumps({**GEMMA2, "intermediate_size": None, "vocab_size": 0}))
    with pytest.raises(ValueError, match="partial.json: missing or non-positive intermediate_size, vocab_size"):
        shapes.named(str(tmp_path / "partial.json"))
    (tmp_path / "heads.json").write_text(json.dumps({**GEMMA2, "num_key_value_heads": 3}))
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads 3"):
        shapes.named(str(tmp_path / "heads.json"))


def test_the_benchmarks_and_the_tuner_take_a_config_path(tmp_path):
    from qerl.bench import kernels, kernels_tune, rollout

    (tmp_path / "config.json").write_text(json.dumps(GEMMA2))
    assert kernels.build_parser().parse_args(["--models", "7B", str(tmp_path)]).models == ["7B", str(tmp_path)]
    assert rollout.build_parser().parse_args(["--models", str(tmp_path)]).models == [str(tmp_path)]
    with pytest.raises(SystemExit):
        kernels.build_parser().parse_args(["--models", str(tmp_path / "missing")])
    # the tuner's engine ranks for such a model: q/k/v at 3 x 32 padded to 128, gate/up 2 x 32 = 64
    assert kernels_tune.engine_ranks(str(tmp_path)) == {(4096, 2304): 128, (2304, 2048): 32, (18432, 2304): 64,
                                                        (2304, 9216): 32}


def test_random_stand_ins_keep_the_configs_head_dim(tmp_path):
    """A model whose head dim is not hidden / heads (Qwen3-4B: 2560 / 32 = 80, head_dim 128) is built with its own."""
    from qerl.models.random import qwen_config

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 2560, "intermediate_size": 9728,
                                                      "num_hidden_layers": 36, "num_attention_heads": 32,
                                                      "num_key_value_heads": 8, "head_dim": 128,
                                                      "vocab_size": 151936}))
    cfg = qwen_config(str(tmp_path))
    assert (cfg.head_dim, cfg.hidden_size, cfg.num_attention_heads) == (128, 2560, 32)
    assert qwen_config("7B").head_dim == 128
