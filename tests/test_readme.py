"""The README as a map: the swap and its limits first, a contents list of every section, links that
resolve (within the README, into docs/ and between the docs), the set-up and test commands CI runs,
the headings other files name, the estimator's example as the estimator prints it, and every figure
of the measured-results table copied from docs/results.md."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
SET_UP = ("    python -m venv .venv && . .venv/bin/activate",
          "    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu   # CPU machine, no GPU",
          '    pip install -e ".[bench]" && flashfsdp-train')
TEST_COMMAND = 'pip install -e ".[test]" && python -m pytest -q'


def _lines_outside_code(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _headings(path: pathlib.Path) -> list[tuple[int, str]]:
    """(level, text) of every Markdown heading of ``path`` outside code blocks."""
    found = []
    for line in _lines_outside_code(path.read_text()):
        match = re.match(r"(#{1,6}) (.+)$", line)
        if match:
            found.append((len(match.group(1)), match.group(2).strip()))
    return found


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = heading.replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _links(path: pathlib.Path) -> list[str]:
    text = "\n".join(_lines_outside_code(path.read_text()))
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_ci_runs_the_readme_test_command_and_the_set_up_is_unchanged():
    lines = README.read_text().splitlines()
    ci_last = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_last == TEST_COMMAND
    assert f"    {TEST_COMMAND}" in lines
    start = lines.index(SET_UP[0])
    assert tuple(lines[start:start + 3]) == SET_UP


def test_the_first_screen_is_the_swap_and_its_limits():
    lines = README.read_text().splitlines()
    first = "\n".join(lines[:45])
    assert [text for level, text in _headings(README) if level == 2][0] == "The drop-in swap"
    assert "from flashfsdp import fully_shard" in first and "# was: from torch.distributed.fsdp import" in first
    assert "| What's different (on by default) | Limits |" in first and "**Not supported yet**" in first
    assert "set_bucket_bytes" in first and "FLASHFSDP_BUCKET_BYTES" in first


def test_the_contents_list_every_section():
    text = README.read_text()
    contents = text[text.index("## Contents"):text.index("\n## ", text.index("## Contents") + 1)]
    sections = [heading for level, heading in _headings(README) if level == 2 and heading != "Contents"]
    for heading in sections:
        assert f"](#{_slug(heading)})" in contents, heading


def test_every_link_resolves():
    bad = []
    for page in [README, *DOCS]:
        for link in _links(page):
            if re.match(r"[a-z]+:", link):
                continue  # http(s), mailto
            target, _, anchor = link.partition("#")
            file = (page.parent / target).resolve() if target else page
            if not file.exists():
                bad.append(f"{page.name}: {link} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in {_slug(h) for _, h in _headings(file)}:
                bad.append(f"{page.name}: {link} (no such heading)")
    assert not bad, bad


def test_headings_that_other_files_name_are_there():
    headings = {text for _, text in _headings(README)}
    # tests/test_public_api.py reads the list under the first; docs/fsdp2_compatibility.md names the second
    assert {"flashfsdp's names beyond FSDP2's", "Not supported yet", "Measured results", "Debugging",
            "Estimating memory before launching"} <= headings
    assert "### flashfsdp's names beyond FSDP2's" in README.read_text().splitlines()


def test_the_debugging_section_covers_the_flight_recorder():
    text = README.read_text()
    section = text[text.index("## Debugging"):text.index("\n## ", text.index("## Debugging") + 1)]
    for needed in ("FLASHFSDP_FLIGHT_RECORDER", "FLASHFSDP_TRACE_DIR", "SIGTERM", "python -m flashfsdp.debug RUN",
                   "set_trace_dir", "CollectiveFailure", "Desync window"):
        assert needed in section, needed


def test_the_measured_figures_are_copied_from_docs_results():
    """Each number of the README's measured-results table appears in docs/results.md as written."""
    text = README.read_text()
    table = text[text.index("| benchmark | device |"):]
    results = " ".join((REPO / "docs" / "results.md").read_text().split())
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) >= 20
    missing = []
    for row in rows:
        figures = re.sub(r"`[^`]*`|\[[^]]*\]\([^)]*\)", "", row[2])  # not code names or links
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", figures):
            if number not in results:
                missing.append(f"{row[0]}: {number}")
    assert not missing, missing


def test_the_estimator_example_is_what_it_prints(tmp_path, capsys):
    pytest.importorskip("transformers")
    from flashfsdp.estimate.__main__ import main  # noqa: PLC0415
    from tests.estimate.test_command_line import LLAMA3_8B  # noqa: PLC0415

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    capsys.readouterr()
    assert main(["--hf-config", str(tmp_path / "config.json"), "--world-size", "64", "--table", "8", "64"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    text = README.read_text()
    command = "`python -m flashfsdp.estimate --hf-config llama-3-8b/config.json --world-size 64 --table 8 64`"
    start = text.index("```text\n", text.index(command)) + len("```text\n")
    assert text[start:text.index("\n```", start)] == printed
    doc = (REPO / "docs" / "estimate.md").read_text()
    start = doc.index("```text\n", doc.index(command)) + len("```text\n")
    assert doc[start:doc.index("\n```", start)] == printed
