"""The README as a map: the swap and its limits first, a contents list of every section, links that
resolve (within the README, into docs/ and between the docs), the set-up and test commands CI runs,
the headings other files name, the estimator's example as the estimator prints it, and every figure
of the measured-results table copied from docs/results.md."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
SET_UP = ("    python -m venv .venv && . .venv/bin/activate",
          "    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu   # CPU machine, no GPU",
          '    pip install -e ".[train]" && flashfsdp-train')
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


# [Note: the README's commands]
# Every command of the README's shell blocks (its fenced ```bash blocks and the set-up lines) is
# run here, in order, in one empty folder, or has a stated reason not to be; a command that matches
# no kind below fails the test, so a new one cannot go untested.
#   - set-up (`python -m venv`, `. .venv/bin/activate`, `pip install ...`): they install into an
#     environment; this test runs in the installed one.
#   - the test suite (`python -m pytest`): this test is part of it.
#   - training (`flashfsdp-train [options]`, `torchrun ... -m flashfsdp.train`): a run of the documented
#     length takes minutes, and several machines for torchrun's. The job's own code resolves the
#     command line (every option known, every value in range, the --config file and --init-from folder
#     read; "..." stands for other options and is left out), and when a later command reads the run,
#     its directory is made as the job leaves it at its last step (`tests.train.trainers.finished_run`).
#   - export (`flashfsdp-train export ...`) runs as written, through the command's entry point.
# The files a reader brings are made first: `hf/llama` (a small transformers Llama), `corpus/`, a
# `tokenizer.json` and `run.toml` (the README's own TOML block). The Python block converting a
# checkpoint with torch's `dcp_to_torch_save` runs as written after the commands.

def _shell_commands(text: str) -> list[str]:
    """The README's set-up lines, then each command of its fenced bash blocks, in order: lines
    joined at a trailing backslash, split at `&&`."""
    lines = [line.strip() for line in SET_UP + (f"    {TEST_COMMAND}",)]
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    return [part.strip() for line in lines for part in line.split("&&") if part.strip()]


def _kind(argv: list[str]) -> str:
    """The kind of a README command (see [Note: the README's commands]), or "" for none."""
    if argv[:3] == ["python", "-m", "venv"] or argv[:1] in (["pip"], ["."]):
        return "set-up"
    if argv[:3] == ["python", "-m", "pytest"]:
        return "the test suite"
    if argv[:2] == ["flashfsdp-train", "export"]:
        return "export"
    if argv[:1] == ["flashfsdp-train"] or (argv[:1] == ["torchrun"] and "flashfsdp.train" in argv):
        return "training"
    return ""


def _files_a_reader_brings(tmp_path) -> None:
    """hf/llama, corpus/, tokenizer.json and run.toml in `tmp_path` (see [Note: the README's commands])."""
    from tests.train.trainers import corpus_text, save_hf_llama  # noqa: PLC0415

    text = README.read_text()
    save_hf_llama(tmp_path / "hf" / "llama")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.py").write_text(corpus_text())
    shutil.copy(tmp_path / "hf" / "llama" / "tokenizer.json", tmp_path / "tokenizer.json")
    start = text.index("```toml\n") + len("```toml\n")
    (tmp_path / "run.toml").write_text(text[start:text.index("```", start)])


class _Runs:
    """The training commands' runs, made when a later command reads them (newest last)."""

    def __init__(self):
        self.pending: dict[str, object] = {}  # absolute --out: the resolved config

    def resolve(self, argv: list[str]) -> None:
        """Resolve a training command line; its run is made if a later command reads it."""
        from flashfsdp.train.config import TrainConfig  # noqa: PLC0415

        args = argv[argv.index("flashfsdp.train") + 1:] if argv[0] == "torchrun" else argv[1:]
        config = TrainConfig.from_argv([arg for arg in args if arg != "..."], warn=False)
        if "..." not in args and argv[0] != "torchrun":
            self.pending[config.run.out] = config

    def read(self, out: str | None) -> None:
        """Make the run an export of `--out out` (None: the newest under runs/) reads."""
        from tests.train.trainers import finished_run  # noqa: PLC0415

        if out is None:
            under = [path for path in self.pending if os.path.dirname(path) == os.path.abspath("runs")]
            out = under[-1] if under else None
        if out is not None and os.path.abspath(out) in self.pending:
            finished_run(self.pending.pop(os.path.abspath(out)))


def test_every_readme_command_runs(tmp_path, monkeypatch):
    """See [Note: the README's commands]."""
    pytest.importorskip("transformers")
    from flashfsdp_cli.train import main  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    _files_a_reader_brings(tmp_path)
    runs, ran = _Runs(), {}
    for command in _shell_commands(README.read_text()):
        argv = shlex.split(command, comments=True)
        kind = _kind(argv)
        assert kind, f"README command {command!r} has no kind in tests/test_readme.py"
        ran.setdefault(kind, []).append(command)
        if kind == "training":
            runs.resolve(argv)
        elif kind == "export":
            runs.read(argv[argv.index("--out") + 1] if "--out" in argv else None)
            assert main(argv[1:]) == 0, command
            to = argv[argv.index("--to") + 1]
            assert (tmp_path / to / "model.safetensors").is_file() and (tmp_path / to / "config.json").is_file()
    assert set(ran) == {"set-up", "the test suite", "training", "export"} and len(ran["export"]) >= 2, ran
    text = README.read_text()
    block = re.search(r"```python\n([^`]*dcp_to_torch_save\(.*?)```", text, re.S).group(1)
    runs.read(re.search(r'dcp_to_torch_save\("([^/]+/[^/]+)/', block).group(1))
    scope = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - the README's own example
    assert "layers.0.attention.wq.weight" in scope["full"] and (tmp_path / "step_200.pt").is_file()
