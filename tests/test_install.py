"""The install: Triton only in the extras that need it, flashfsdp working without it on CPU (and
refusing CUDA tensors with the extra to install), and the torch version checked at import."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

from flashfsdp import _torch_private

REPO = pathlib.Path(__file__).resolve().parent.parent

# A meta-path finder that makes ``import triton`` (and its submodules) fail as on a CPU install.
BLOCK_TRITON = """
import importlib.abc, sys
class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoTriton())
"""

# W = 1 training of a small model with fully_shard units against the same model unsharded.
TRAIN_WITHOUT_TRITON = BLOCK_TRITON + """
import json, torch, torch.nn as nn
import flashfsdp
from flashfsdp.kernels import dispatch, triton_support

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

def train(m, steps=3):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = m(torch.randn(5, 8, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.item()

sharded = model()
for layer in (sharded[0], sharded[2]):
    flashfsdp.fully_shard(layer)
flashfsdp.fully_shard(sharded)
dispatch.reset_backend_counts()
result = {"loss": train(sharded), "reference_loss": train(model()),
          "triton_imported": "triton" in sys.modules, "available": triton_support.AVAILABLE,
          "backends": sorted({backend for (_, backend, _) in dispatch.backend_counts()})}
try:
    dispatch.select_backend(torch.device("cuda", 0))
except RuntimeError as error:
    result["cuda_error"] = str(error)
print(json.dumps(result))
"""


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter at the repository root."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


def _setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """install_requires and extras_require, read from setup.py's ``setup(...)`` call: literals, and
    names of module-level literal lists (``CLIENTS``) unpacked into them."""
    tree = ast.parse((REPO / "setup.py").read_text())
    names = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
             if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    keywords = {k.arg: k.value for k in call.keywords}

    def value(node):
        if isinstance(node, ast.Name):
            return names[node.id]
        if isinstance(node, ast.List):
            out = []
            for item in node.elts:
                out.extend(value(item.value)) if isinstance(item, ast.Starred) else out.append(value(item))
            return out
        if isinstance(node, ast.Dict):
            return {value(k): value(v) for k, v in zip(node.keys, node.values)}
        return ast.literal_eval(node)

    return value(keywords["install_requires"]), value(keywords["extras_require"])


def test_triton_is_in_the_extras_that_need_it_not_in_the_cpu_install():
    requires, extras = _setup_requirements()
    assert not [r for r in requires if r.startswith("triton")]
    for extra in ("test", "cuda12", "cuda13"):
        assert "triton>=3.4" in extras[extra], extra
    assert f"torch>={'.'.join(map(str, _torch_private.MIN_TORCH))}" in requires


def test_cpu_training_works_without_triton_and_cuda_names_the_extra():
    done = run_python(TRAIN_WITHOUT_TRITON, TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["triton_imported"] is False and result["available"] is False
    assert result["backends"] == ["reference"]
    assert result["loss"] == pytest.approx(result["reference_loss"], rel=1e-5)
    assert "triton cannot be imported" in result["cuda_error"]
    assert "pip install 'flashfsdp[cuda12]'" in result["cuda_error"] and "'flashfsdp[cuda13]'" in result["cuda_error"]


def test_an_old_torch_is_refused_at_import():
    version = "2.5.1"
    done = run_python(f"import torch\ntorch.__version__ = {version!r}\nimport flashfsdp\n")
    assert done.returncode != 0
    assert f"ImportError: flashfsdp needs torch >= 2.6, found torch {version}" in done.stderr
    assert "pip install 'torch>=2.6'" in done.stderr


@pytest.mark.parametrize("version", ["2.6.0", "2.13.0+cpu", "2.14.0a0+git1234", "3.0"])
def test_supported_versions_pass(version):
    _torch_private.check_torch_version(version)


@pytest.mark.parametrize("version, match", [("2.5.99", "needs torch >= 2.6"), ("1.13.1+cu117", "found torch 1.13.1"),
                                            ("nightly", "cannot read the torch version")])
def test_unsupported_or_unreadable_versions_are_import_errors(version, match):
    with pytest.raises(ImportError, match=match):
        _torch_private.check_torch_version(version)
