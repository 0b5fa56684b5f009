"""The command lines: `flashfsdp-train --help` and its usage errors answer before torch is imported
and list `export`; `python -m flashfsdp.estimate` names its dtypes first, takes a transformers
config, prints human units and survives a closed pipe; `python -m flashfsdp.sim` states its
assumptions and prints one row per TP degree."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Runs flashfsdp-train's entry point, then says whether torch was imported.
_ENTRY = """
import sys
from flashfsdp_cli.train import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
print("torch imported:", "torch" in sys.modules, "code:", code)
"""


def _entry(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _ENTRY, *argv], capture_output=True, text=True, timeout=120)


def test_help_answers_before_torch_and_lists_export():
    done = _entry("--help")
    assert done.stdout.strip().endswith("torch imported: False code: 0"), done.stderr
    assert "flashfsdp-train export --out RUN --to DIR" in done.stdout and "--init-from DIR" in done.stdout
    export = _entry("export", "--help")
    assert "torch imported: False code: 0" in export.stdout and "--step N" in export.stdout


def test_help_is_grouped_by_the_config_sections():
    from flashfsdp_cli.train_sections import OPTIONS, SECTIONS  # noqa: PLC0415

    text = _entry("--help").stdout
    starts = [text.index(f"\n{name}:\n") for name in SECTIONS]
    assert starts == sorted(starts)  # one group per section, in order
    words = " ".join(text.split())
    for name in SECTIONS:
        assert f"([{name}] in a --config file)" in words
    for opt in OPTIONS:  # each option in its section's group
        group = [s for s in starts if s < text.index(f"  {opt.flag}")][-1]
        assert group == starts[list(SECTIONS).index(opt.section)], opt.flag
    assert "--reshard-after-forward {default,true,false,N}" in text and "[data] path in a --config file" in words


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--steps", "0"], "--steps must be positive, got 0"),
    (["--lr", "1e-3", "--min-lr", "1"], "--min-lr in [0, lr]"),
    (["--log-ranks", "some"], "--log-ranks 'some': give 0, all, or ranks such as 0,3"),
    (["--reshard-after-forward", "maybe"], "argument --reshard-after-forward: give true, false, default or a number"),
    (["--reshard-after-forward", "-1"], "--reshard-after-forward must be true, false or a positive integer, got -1"),
    (["--param-dtype", "fp8"], "argument --param-dtype: invalid choice: 'fp8'"),
    (["--tp", "0"], "--tp must be positive, got 0"),
    (["export", "--out", "run"], "the following arguments are required: --to"),
])
def test_usage_errors_are_one_line_before_torch(argv, message):
    done = _entry(*argv)
    assert "torch imported: False code: 2" in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashfsdp-train") and message in lines[0], done.stderr


def _estimate(capsys, *argv: str) -> tuple[int, str, str]:
    """`python -m flashfsdp.estimate` run in this process (its `main`, which the module runs): the
    exit code, stdout and stderr. Only the closed pipe below needs a process of its own."""
    from flashfsdp.estimate.__main__ import main  # noqa: PLC0415

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_names_its_dtypes_first_and_prints_human_units(capsys):
    code, out, err = _estimate(capsys, "--preset", "tiny", "--world-size", "8", "--table", "8")
    assert code == 0, err
    first = out.splitlines()[0]
    assert first.startswith("Llama tiny: ") and "dtypes assumed: float32 master weights" in first
    assert "param_dtype fp32 (default), reduce_dtype fp32 (= param_dtype)" in first
    assert " 0.00" not in out and " KiB" in out
    _, bf16, _ = _estimate(capsys, "--preset", "tiny", "--world-size", "8", "--param-dtype", "bf16", "--table")
    assert "param_dtype bf16, reduce_dtype bf16 (= param_dtype)" in bf16.splitlines()[0]


def test_estimate_of_a_transformers_config(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 3, "num_attention_heads": 4, "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = _estimate(capsys, "--hf-config", str(tmp_path / "config.json"), "--world-size", "2", "--table")
    assert code == 0, err
    assert out.startswith("LlamaForCausalLM (llama): ") and ", 4 units, W = 2;" in out
    code, _, err = _estimate(capsys, "--hf-config", str(tmp_path / "missing.json"), "--world-size", "2")
    assert code == 2 and err.startswith("python -m flashfsdp.estimate: error: --hf-config ")


def test_estimate_survives_a_closed_pipe():
    done = subprocess.run(f"{sys.executable} -m flashfsdp.estimate --preset 8b --world-size 64 | head -1",
                          shell=True, capture_output=True, text=True, timeout=300)
    assert done.stdout.startswith("Llama 8b: ") and len(done.stdout.splitlines()) == 1
    assert "BrokenPipeError" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_estimate_with_tensor_parallelism(capsys):
    code, out, err = _estimate(capsys, "--preset", "tiny", "--world-size", "4", "--tp", "2", "--tokens", "256", "--table")
    assert code == 0, err
    assert "W = 4, (dp, tp) = (2, 2);" in out.splitlines()[0]
    assert "TP all-gathered (" in out and "over 2 ranks, 256 tokens)" in out
    code, _, err = _estimate(capsys, "--preset", "tiny", "--world-size", "4", "--tp", "3")
    assert code == 2 and err.strip() == "python -m flashfsdp.estimate: error: estimate: tp=3 must divide world_size=4"


def test_sim_prints_its_assumptions_and_one_row_per_tp(capsys):
    done = subprocess.run([sys.executable, "-m", "flashfsdp.sim", "--preset", "tiny", "--world-size", "4",
                           "--tp", "1", "2", "--tokens", "256"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Llama tiny, W = 4, 256 tokens per TP group") and "FLOP/s" in lines[0]
    assert "data-parallel InfiniBand 400 Gb/s: α = 8 µs, β = 50 GB/s; TP NVLink" in lines[1]
    rows = [line.split() for line in lines if line.split()[:1] in (["1"], ["2"])]
    assert [r[:2] for r in rows] == [["1", "4"], ["2", "2"]]
    assert float(rows[0][4]) == 0 and float(rows[1][4]) > 0  # the TP collectives' time
    from flashfsdp.sim.__main__ import main  # noqa: PLC0415

    assert main(["--preset", "tiny", "--world-size", "4", "--tp", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "python -m flashfsdp.sim: error: llama_tp_model: tp must be an integer >= 1 dividing world_size=4, got 3")
