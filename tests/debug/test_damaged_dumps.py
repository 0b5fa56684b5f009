"""``python -m flashfsdp.debug`` on damaged dumps: one line naming the file and what is wrong
(exit status 2), never a traceback, and bounded memory whatever the dump claims."""

from __future__ import annotations

import json
import resource

import pytest

from flashfsdp.debug import MAX_DUMP_BYTES
from flashfsdp.debug.__main__ import main as debug_main


def _report(rank: int = 0) -> dict:
    entry = {"seq": 1, "kind": "all_gather", "group": [0, 1], "unit": "layers.0", "phase": "forward", "step": 1,
             "nbytes": 64, "state": "waiting", "issued_at": 0.0, "ended_at": None}
    return {"rank": rank, "world_size": 2, "reason": "timeout", "error": "RuntimeError: Timed out",
            "position": {"step": 1, "phase": "forward", "unit": "layers.0", "last_seq": 1, "waiting": dict(entry)},
            "entries": [entry]}


def _without(key):
    def damage(report):
        del report[key]
    return damage


def _set(key, value):
    def damage(report):
        report[key] = value
    return damage


def _entry_set(key, value):
    def damage(report):
        report["entries"][0][key] = value
    return damage


@pytest.mark.parametrize("damage, words", [
    (_without("entries"), "it has no 'entries'"),
    (_without("position"), "it has no 'position'"),
    (_set("entries", {"0": 1}), "'entries' is dict, not a list"),
    (_set("rank", "zero"), "'rank' is 'zero', not an integer"),
    (_set("rank", 1.0), "'rank' is 1.0, not an integer"),
    (_set("world_size", 10 ** 12), "'world_size' is 1000000000000, outside 1 .. 1048576"),
    (_set("world_size", 0), "'world_size' is 0, outside 1 .. 1048576"),
    (_set("position", []), "'position' is list, not an object"),
    (_entry_set("seq", "7"), "entry 0's 'seq' is '7', not an integer"),
    (_entry_set("kind", None), "entry 0's 'kind' is None, not a string"),
    (_entry_set("group", "0,1"), "entry 0's 'group' is '0,1', not a list of ranks"),
])
def test_a_damaged_dump_is_one_line_naming_the_file(tmp_path, capsys, damage, words):
    report = _report()
    damage(report)
    (tmp_path / "flight").mkdir()
    path = tmp_path / "flight" / "flight_rank0.json"
    path.write_text(json.dumps(report))
    assert debug_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{path}: not a flashfsdp flight recorder dump: {words}" in err, err


@pytest.mark.parametrize("text, words", [
    ("[1, 2]", "it holds list, not an object"),
    ("{\"rank\": 0,", "Expecting"),
    ("[" * 100000 + "]" * 100000, "nested too deep"),
])
def test_not_json_or_not_an_object(tmp_path, capsys, text, words):
    (tmp_path / "flight").mkdir()
    (tmp_path / "flight" / "flight_rank0.json").write_text(text)
    assert debug_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "flight_rank0.json" in err, err


def test_a_rank_other_than_the_file_names_and_a_huge_file(tmp_path, capsys):
    (tmp_path / "flight").mkdir()
    (tmp_path / "flight" / "flight_rank1.json").write_text(json.dumps(_report(0)))
    assert debug_main([str(tmp_path)]) == 2
    assert "'rank' is 0, but the file is rank 1's" in capsys.readouterr().err
    huge = tmp_path / "flight" / "flight_rank1.json"
    with open(huge, "wb") as f:
        f.truncate(MAX_DUMP_BYTES + 1)  # (sparse: no disk used)
    assert debug_main([str(tmp_path)]) == 2
    assert f"it is {MAX_DUMP_BYTES + 1} bytes, more than the {MAX_DUMP_BYTES} a dump can be" in capsys.readouterr().err


def test_a_large_world_size_that_is_allowed_stays_in_bounded_memory(tmp_path, capsys):
    # a job of a million ranks and one dump: the absent ranks are one range, not a million lines
    report = _report(5)
    report["world_size"] = 1 << 20
    (tmp_path / "flight").mkdir()
    (tmp_path / "flight" / "flight_rank5.json").write_text(json.dumps(report))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert debug_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ranks 0-4 sent no report" in out and "ranks 6-1048575 sent no report" in out
    assert len(out) < 4000
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: under 200 MiB more
