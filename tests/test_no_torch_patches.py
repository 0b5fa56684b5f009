"""Importing flashfsdp leaves torch's functions as they were: flashfsdp replaces nothing in torch's
namespaces, so code that uses torch directly gets torch's behaviour whether or not flashfsdp was
imported. Each function is checked in a fresh interpreter: before and after the import, every
module that exposes it must hold the very same object."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent

# A torch function -> the modules that expose it (one line per function).
UNTOUCHED = {
    "destroy_process_group": ("torch.distributed", "torch.distributed.distributed_c10d"),
    "clip_grad_norm_": ("torch.nn.utils", "torch.nn.utils.clip_grad"),
}

# What flashfsdp's import changed: the "module.function" of every entry that now holds another
# object. The modules that used to replace them are imported too, in case the package stops
# importing them itself.
PROBE = """
import importlib, json, sys
untouched = json.loads(sys.argv[1])
def current():
    return {f"{module}.{name}": getattr(importlib.import_module(module), name)
            for name, modules in untouched.items() for module in modules}
before = current()
import flashfsdp
import flashfsdp.runtime.nccl
after = current()
print(json.dumps(sorted(where for where in before if after[where] is not before[where])))
"""


@pytest.mark.parametrize("name", sorted(UNTOUCHED))
def test_importing_flashfsdp_leaves_the_torch_function_as_it_was(name):
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps({name: UNTOUCHED[name]})], cwd=REPO,
                            env=os.environ.copy(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    replaced = json.loads(result.stdout.strip().splitlines()[-1])
    assert replaced == [], f"importing flashfsdp replaced torch's {', '.join(replaced)}"
