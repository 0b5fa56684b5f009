"""flashfsdp-train --reduce-quantization int8|int4 --ranks-per-node N: ZeRO++ qgZ for every unit's
gradient reduction, N consecutive data-parallel ranks playing a node (2 "nodes" of 2 on one
machine at --nproc 4); refused before torch where it cannot apply, saved in run.json, and a few
steps train like the plain reduce-scatter with the flight recorder's qgZ hops in each step."""

from __future__ import annotations

import json

import pytest
import torch

import flashfsdp
from flashfsdp.train.checks import validate
from flashfsdp.train.config import TrainConfig, UsageError
from flashfsdp_cli.train import main as front
from tests.harness import run_distributed

QGZ = ["--reduce-quantization", "int4", "--ranks-per-node", "2"]
TINY = ["--preset", "tiny", "--layers", "1", "--steps", "3", "--seq-len", "16", "--batch-size", "8",
        "--eval-batches", "1", "--sample-tokens", "0"]


def test_options_make_the_policy(tmp_path):
    plain = TrainConfig.from_argv([*TINY, "--out", str(tmp_path / "a")])
    int4 = TrainConfig.from_argv([*TINY, *QGZ, "--out", str(tmp_path / "b")])
    int8 = TrainConfig.from_argv([*TINY, "--reduce-quantization", "int8", "--ranks-per-node", "4",
                                  "--out", str(tmp_path / "c")])
    assert plain.sharding.reduce_quantization is None and plain.precision.policy.reduce_quantization is None
    assert int4.sharding.reduce_quantization == "int4" and int4.sharding.ranks_per_node == 2
    assert int4.precision.policy.reduce_quantization == flashfsdp.QuantizedReduce(bits=4, local_size=2)
    assert int8.precision.policy.reduce_quantization == flashfsdp.QuantizedReduce(bits=8, local_size=4)


def test_config_file_keys(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[sharding]\nreduce_quantization = "int8"\nranks_per_node = 2\n')
    config = TrainConfig.from_argv([*TINY, "--config", str(toml), "--out", str(tmp_path / "run")])
    assert config.precision.policy.reduce_quantization == flashfsdp.QuantizedReduce(bits=8, local_size=2)


@pytest.mark.parametrize("argv, words", [
    (["--reduce-quantization", "int4"], "needs --ranks-per-node"),
    (["--ranks-per-node", "2"], "give --reduce-quantization"),
    (["--reduce-quantization", "int4", "--ranks-per-node", "3", "--nproc", "4"], "1, 2, 4"),
    (["--reduce-quantization", "int4", "--ranks-per-node", "4", "--nproc", "4", "--tp", "2"], "1, 2"),
    (["--reduce-quantization", "int4", "--ranks-per-node", "0"], "must be positive"),
    (["--reduce-quantization", "int2", "--ranks-per-node", "2"], "invalid choice"),
])
def test_front_refuses_before_torch(argv, words, capsys):
    try:
        code = front([*argv, "--steps", "3"])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "--r" in err and len(err.splitlines()) == 1, err


def test_job_refuses_a_node_size_not_dividing_its_world(tmp_path):
    config = TrainConfig.from_argv([*TINY, "--reduce-quantization", "int8", "--ranks-per-node", "3",
                                    "--out", str(tmp_path / "run")])
    with pytest.raises(UsageError, match="--ranks-per-node 3 does not divide the 4 data-parallel"):
        validate(config, 4, 4)


def test_saved_and_a_changed_value_named_on_resume(tmp_path):
    out = str(tmp_path / "run")
    TrainConfig.from_argv([*TINY, *QGZ, "--out", out]).save()
    saved = json.loads((tmp_path / "run" / "run.json").read_text())["sharding"]
    assert saved["reduce_quantization"] == "int4" and saved["ranks_per_node"] == 2
    resumed = TrainConfig.from_argv([*TINY, "--reduce-quantization", "int8", "--ranks-per-node", "2",
                                     "--resume", "--out", out])
    assert resumed.precision.policy.reduce_quantization.bits == 8
    assert resumed.record_resumption(1, 4)["changed"] == {"sharding.reduce_quantization": ["int4", "int8"]}


def _losses(rank: int, world_size: int, out: str, corpus_file: str, flag: list[str]) -> dict:
    from flashfsdp.runtime import flight  # noqa: PLC0415
    from flashfsdp.train.data import load_corpus  # noqa: PLC0415
    from flashfsdp.train.trainer import Trainer  # noqa: PLC0415

    config = TrainConfig.from_argv([*TINY, *flag, "--out", out, "--data", corpus_file], warn=False)
    trainer = Trainer(config, load_corpus(corpus_file), rank, world_size, torch.device("cpu"))
    before = flight.entries()[-1].seq if flight.entries() else 0
    losses = [trainer.train_step()[0]["train_loss"] for _ in range(3)]
    hops = [(e.kind, e.unit) for e in flight.entries() if e.seq > before]
    return {"losses": losses, "hops": hops}


def _both(rank: int, world_size: int, tmp: str, corpus_file: str) -> dict:
    return {"int4": _losses(rank, world_size, f"{tmp}/int4", corpus_file, QGZ),
            "plain": _losses(rank, world_size, f"{tmp}/plain", corpus_file, [])}


def test_two_nodes_of_two_train_like_the_reduce_scatter(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200)))
    for got in run_distributed(_both, 4, str(tmp_path), str(corpus), timeout=240):
        kinds = {k for k, _ in got["int4"]["hops"]}
        assert {"all_to_all (qgZ intra)", "all_to_all (qgZ inter)"} <= kinds, kinds
        assert not any("qgZ" in k for k, _ in got["plain"]["hops"])
        assert all(u for k, u in got["int4"]["hops"] if "qgZ" in k)  # each hop names its unit
        torch.testing.assert_close(got["int4"]["losses"], got["plain"]["losses"], rtol=1e-2, atol=0)
        assert got["int4"]["losses"] != got["plain"]["losses"]  # quantised, not the plain path
