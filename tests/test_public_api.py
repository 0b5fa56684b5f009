"""The public namespace: ``flashfsdp.__all__`` is ``torch.distributed.fsdp``'s names (FSDP2's and
FSDP1's) plus flashfsdp's own, and each of its own is listed in the README under "flashfsdp's
names beyond FSDP2's" — no more, no fewer — and documented."""

from __future__ import annotations

import pathlib
import re

import torch.distributed.fsdp

import flashfsdp

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
HEADING = "### flashfsdp's names beyond FSDP2's"


def _readme_extras() -> list[str]:
    """The names of the README's list of flashfsdp's own names (the first list after the heading)."""
    lines = README.read_text().splitlines()
    start = lines.index(HEADING)
    names, in_list = [], False
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("- "):
            in_list = True
            match = re.match(r"- `([A-Za-z_][A-Za-z0-9_]*)` — ", line)
            assert match, f"README list entry not of the form '- `name` — what it is': {line}"
            names.append(match.group(1))
        elif in_list and not line.startswith("  "):
            break
    return names


def test_all_is_fsdps_names_plus_the_readme_list():
    torch_names = set(torch.distributed.fsdp.__all__)
    extras = _readme_extras()
    assert len(extras) == len(set(extras)), extras
    assert not set(extras) & torch_names, "listed as flashfsdp's own but torch.distributed.fsdp has them"
    assert {n for n in flashfsdp.__all__ if n not in torch_names} == set(extras)
    assert len(flashfsdp.__all__) == len(set(flashfsdp.__all__))


def test_every_public_name_exists_and_is_documented():
    for name in flashfsdp.__all__:
        value = getattr(flashfsdp, name)
        assert (value.__doc__ or "").strip(), f"flashfsdp.{name} has no docstring"
