"""``python -m flashfsdp.estimate`` on a Llama-3 8B: FSDP's mixed precision by default (fp32 master
weights, gradients and AdamW state: the 16 bytes per parameter of ZeRO's accounting, whatever dtype
the config.json was saved in), ``--master-dtype`` to say otherwise, DeepSpeed's formula compared
part by part, the unit that sets the peak named; bad config fields and world sizes as one-line
errors with exit code 2."""

from __future__ import annotations

import json
import re

import pytest

from flashfsdp.estimate.__main__ import main
from flashfsdp.estimate.report import human_bytes

# Meta's Llama-3 8B config.json as published (saved in bfloat16, as such files are).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}
PARAMS = 8_030_261_248  # Llama-3 8B
TENSORS = 32 * 9 + 3  # per block: 2 norms, 4 attention and 3 feed-forward weights; embedding, norm, output
EMBEDDING = 128256 * 4096  # DeepSpeed's largest layer (the module with the most parameters of its own)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _bytes(out: str, label: str) -> int:
    """The bytes column of the memory table's row ``label``."""
    match = re.search(rf"^{re.escape(label)}\s+([\d,]+)\s", out, re.M)
    assert match, f"no row {label!r} in:\n{out}"
    return int(match.group(1).replace(",", ""))


def _states(out: str) -> int:
    return sum(_bytes(out, label) for label in ("master parameters (sharded)", "gradients (sharded)",
                                                "optimizer state (adamw)"))


def _table_row(out: str, world_size: int) -> list[str]:
    """The cells of the world-size table's row of W = ``world_size`` (split on 2+ spaces)."""
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == str(world_size) and len(cells) == 8:
            return cells
    raise AssertionError(f"no table row for W = {world_size} in:\n{out}")


@pytest.fixture
def llama3_8b(tmp_path, capsys):
    """A Llama-3 8B config.json (transformers imported first, so its import messages are not the
    command's)."""
    pytest.importorskip("transformers")
    capsys.readouterr()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    return str(path)


def test_llama3_8b_config_against_16_bytes_per_param_at_w8_and_w64(llama3_8b, capsys):
    """fp32 masters, gradients and AdamW's two moments: 16 bytes per parameter / W, plus AdamW's
    4-byte step per parameter tensor (no padding at W = 8 or 64: every dim divides), although the
    config says bfloat16 — that is the unsharded parameters' dtype."""
    code, out8, err = _run(capsys, "--hf-config", llama3_8b, "--world-size", "8", "--table")
    assert code == 0, err
    first = out8.splitlines()[0]
    assert first.startswith(f"LlamaForCausalLM (llama): {PARAMS:,} parameters, 33 units, W = 8;")
    assert ("dtypes assumed: float32 master weights, gradients and adamw state (default), param_dtype bf16 "
            "(config.json torch_dtype), reduce_dtype bf16 (= param_dtype)") in first
    assert _states(out8) == 16 * PARAMS // 8 + 4 * TENSORS  # 14.96 GiB, not the 7.48 of bf16 states
    assert _bytes(out8, "master parameters (sharded)") == 4 * PARAMS // 8

    code, out64, err = _run(capsys, "--hf-config", llama3_8b, "--world-size", "64", "--table", "8", "64")
    assert code == 0, err
    states64 = _states(out64)
    assert states64 == 16 * PARAMS // 64 + 4 * TENSORS
    # at W = 8 the sharded states set the total; at W = 64 the step's peak does, set by the root:
    # the embedding and the output projection (1.05B parameters), gathered in bf16
    assert _bytes(out8, "step peak on top of the states") < _states(out8)
    assert _bytes(out64, "step peak on top of the states") > states64
    assert ("peak set by: <root> (model.embed_tokens, model.norm, lm_head: 1,050,677,248 params, 1.96 GiB "
            "unsharded); largest unit: <root>") in out64
    for w, states in ((8, _states(out8)), (64, states64)):
        row = _table_row(out64, w)
        assert row[1] == human_bytes(states) and row[3] == "<root>"
        # DeepSpeed's own formula: 18 bytes per parameter / W, + 4 per parameter of its largest layer
        assert row[6:] == [human_bytes(int(18 * PARAMS / w)), human_bytes(4 * EMBEDDING + int(18 * PARAMS / w))]
    assert "18 bytes per parameter / W (a 16-bit parameter 2, fp32 master 4" in " ".join(out64.split())
    assert f"its largest layer here: {EMBEDDING:,} params" in " ".join(out64.split())


def test_master_dtype_says_otherwise(llama3_8b, capsys):
    code, out, err = _run(capsys, "--hf-config", llama3_8b, "--world-size", "8", "--master-dtype", "bf16",
                          "--param-dtype", "fp32", "--table")
    assert code == 0, err
    assert ("dtypes assumed: bfloat16 master weights, gradients and adamw state, param_dtype fp32, reduce_dtype fp32 "
            "(= param_dtype)") in out.splitlines()[0]
    assert _states(out) == 8 * PARAMS // 8 + 4 * TENSORS


def test_preset_8b_is_16_bytes_per_param_too(capsys):
    for w in (8, 64):
        code, out, err = _run(capsys, "--preset", "8b", "--world-size", str(w), "--param-dtype", "bf16", "--table")
        assert code == 0, err
        assert "float32 master weights, gradients and adamw state (default), param_dtype bf16, " in out
        assert _states(out) == 16 * PARAMS // w + 4 * TENSORS
        assert "peak set by: <root> (tok_embeddings, norm, output: 1,050,677,248 params" in out


def _one_line_error(capsys, argv) -> str:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == "", (code, out)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m flashfsdp.estimate: error: "), err
    return lines[0]


@pytest.mark.parametrize("field, value, message", [
    ("intermediate_size", "5632", "intermediate_size must be an integer >= 1, got '5632' (a string: write the "
                                  "number without quotes)"),
    ("hidden_size", -4096, "hidden_size must be an integer >= 1, got -4096"),
    ("num_hidden_layers", -1, "num_hidden_layers must be an integer >= 1, got -1"),
    ("vocab_size", 0, "vocab_size must be an integer >= 1, got 0"),
    ("hidden_size", 4096.5, "hidden_size must be an integer >= 1, got 4096.5"),
    ("num_attention_heads", True, "num_attention_heads must be an integer >= 1, got True"),
    ("num_local_experts", -2, "num_local_experts must be an integer >= 0, got -2"),
    ("text_config", {"hidden_size": "64"}, "text_config.hidden_size must be an integer >= 1, got '64' (a string: "
                                           "write the number without quotes)"),
    ("torch_dtype", "int4", "torch_dtype 'int4' is none of float32, float, bfloat16, float16, half; pass "
                            "--param-dtype"),
])
def test_config_fields_of_the_wrong_type_or_sign(tmp_path, capsys, field, value, message):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_8B, field: value}))
    line = _one_line_error(capsys, ["--hf-config", str(tmp_path), "--world-size", "8"])
    assert line.endswith(f"--hf-config {tmp_path}: {message}"), line


def test_config_files_that_are_not_an_object(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    assert "expected a JSON object of config fields, got a list" in _one_line_error(
        capsys, ["--hf-config", str(path), "--world-size", "8"])
    path.write_text("{")
    assert "cannot read it as JSON (" in _one_line_error(capsys, ["--hf-config", str(path), "--world-size", "8"])


def test_what_transformers_refuses_is_one_line_too(llama3_8b, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_8B, "rms_norm_eps": "x"}))
    line = _one_line_error(capsys, ["--hf-config", str(tmp_path / "config.json"), "--world-size", "8"])
    assert "not a transformers config (" in line and "rms_norm_eps" in line


@pytest.mark.parametrize("table, message", [
    (["0"], "argument --table: a world size is an integer >= 1, got 0 (see --help)"),
    (["-4"], "argument --table: a world size is an integer >= 1, got -4 (see --help)"),
    (["8", "x"], "argument --table: expected a world size (an integer >= 1), got 'x' (see --help)"),
])
def test_table_world_sizes_are_positive(capsys, table, message):
    line = _one_line_error(capsys, ["--preset", "tiny", "--world-size", "8", "--table", *table])
    assert line == f"python -m flashfsdp.estimate: error: {message}"


def test_a_table_row_that_cannot_be_estimated_names_its_world_size(capsys):
    line = _one_line_error(capsys, ["--preset", "tiny", "--world-size", "9", "--reshard-after-forward", "3",
                                    "--table", "9", "8"])
    assert line.startswith("python -m flashfsdp.estimate: error: --table 8: ") and "reshard_after_forward=3" in line
