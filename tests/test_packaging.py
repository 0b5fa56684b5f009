"""The package as pip installs it: only flashfsdp and its command lines (no top-level benchmarks),
tomli where Python lacks tomllib, and a training run that leaves no temporary folders behind."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def _setup_call() -> dict:
    """The keyword arguments of setup.py's setup() call, as source text."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    return {k.arg: ast.unparse(k.value) for k in call.keywords}


def test_pip_installs_no_top_level_benchmarks_package():
    from setuptools import find_packages  # noqa: PLC0415

    include = ast.literal_eval(_setup_call()["packages"].split("include=", 1)[1].rstrip(")"))
    packages = find_packages(where=str(REPO), include=include)
    assert "flashfsdp" in packages and "flashfsdp_cli" in packages and "flashfsdp.train" in packages
    assert not [p for p in packages if p.split(".")[0] not in ("flashfsdp", "flashfsdp_cli")], packages


def test_python_requires_and_tomli_agree():
    kwargs = _setup_call()
    assert kwargs["python_requires"] == "'>=3.10'"
    assert "tomli; python_version < '3.11'" in kwargs["install_requires"]
    assert "flashfsdp-train=flashfsdp_cli.train:main" in kwargs["entry_points"]


def test_a_run_and_the_fsdp1_example_leave_no_temporary_folders(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TMPDIR"] = str(scratch)
    run = subprocess.run([sys.executable, "-m", "flashfsdp.train", "--layers", "1", "--steps", "1", "--eval-batches",
                          "1", "--sample-tokens", "0", "--out", str(tmp_path / "run")], capture_output=True,
                         text=True, timeout=300, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    example = subprocess.run([sys.executable, "examples/fsdp1_to_flashfsdp.py"], capture_output=True, text=True,
                             timeout=300, env=env, cwd=REPO)
    assert example.returncode == 0, example.stderr[-3000:]
    # torch's compile cache (torchinductor_<user>) is a cache shared by later runs, not a leftover
    assert [name for name in os.listdir(scratch) if not name.startswith("torchinductor_")] == []


def test_the_readme_says_how_to_set_up_and_to_use_checkpoints():
    readme = (REPO / "README.md").read_text()
    for needed in ("python -m venv", "--index-url https://download.pytorch.org/whl/cpu", "flashfsdp.checkpoint.save(",
                   "flashfsdp.checkpoint.load(", "dcp_to_torch_save", "--init-from", "--freeze"):
        assert needed in readme, needed
