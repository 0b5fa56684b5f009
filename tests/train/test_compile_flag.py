"""--compile: each block torch.compile'd after sharding trains to the losses of the run without it
(fp32, 1e-5); where torch.compile does not work, the run stops before any worker with one line."""

from __future__ import annotations

import pytest
import torch

from flashfsdp.models import Block
from flashfsdp.train.cli import main
from flashfsdp.train.config import TrainConfig, UsageError
from flashfsdp.train.sharding import check_compile
from tests.harness import run_distributed
from tests.train.trainers import TINY, corpus_text, make_trainer

STEPS = 3


def _losses(rank: int, world_size: int, root: str, corpus: str) -> dict:
    # The blocks compile with Dynamo and AOTAutograd through aot_eager here: inductor's code
    # generation for a Llama block takes most of a minute on two shared cores (the inductor case
    # of per-block compile is tests/bindings/test_compile.py's).
    compile_method = torch.nn.Module.compile
    torch.nn.Module.compile = lambda self, **kwargs: compile_method(self, **{"backend": "aot_eager", **kwargs})
    got = {}
    for name, flags in (("eager", []), ("compiled", ["--compile"])):
        trainer = make_trainer(["--data", corpus, "--steps", str(STEPS), "--out", f"{root}/{name}", *flags])
        losses = [trainer.train_step()[0]["train_loss"] for _ in range(STEPS)]
        blocks = [m for m in trainer.model.modules() if isinstance(m, Block)]
        got[name] = {"losses": losses, "compiled": [b._compiled_call_impl is not None for b in blocks]}
    return got


def test_compiled_blocks_train_to_the_eager_losses(tmp_path):
    corpus = tmp_path / "corpus.py"
    corpus.write_text(corpus_text())
    for got in run_distributed(_losses, 2, str(tmp_path), str(corpus), timeout=240):
        assert got["eager"]["compiled"] == [False, False] and got["compiled"]["compiled"] == [True, True]
        torch.testing.assert_close(got["compiled"]["losses"], got["eager"]["losses"], rtol=1e-5, atol=1e-5)


def test_the_flag_defaults_off(tmp_path):
    assert TrainConfig.from_argv(["--out", str(tmp_path)]).training.compile is False
    assert TrainConfig.from_argv(["--out", str(tmp_path), "--compile"]).training.compile is True


def test_the_compile_check_passes_where_torch_compile_works():
    check_compile("cpu")  # the default backend (inductor) compiles and runs a small function


def _unsupported(*args, **kwargs):
    raise RuntimeError("torch.compile is not supported on Python 3.99+\n(more detail)")


def _fails_at_first_call(*args, **kwargs):
    def compiled(*call_args):
        from torch._inductor.exc import InductorError  # noqa: PLC0415

        raise InductorError(RuntimeError("no C++ compiler found\n(more detail)"), None)

    return compiled


@pytest.mark.parametrize("compile_fn, reason", [
    (_unsupported, "RuntimeError: torch.compile is not supported on Python 3.99+"),
    (_fails_at_first_call, "RuntimeError: no C++ compiler found"),
])
def test_where_torch_compile_fails_the_run_stops_with_one_line(tmp_path, capsys, monkeypatch, compile_fn, reason):
    corpus = tmp_path / "corpus.py"
    corpus.write_text(corpus_text())
    monkeypatch.setattr(torch, "compile", compile_fn)
    with pytest.raises(UsageError, match="^--compile: torch.compile does not work on this machine"):
        check_compile("cpu")
    assert main([*TINY, "--data", str(corpus), "--out", str(tmp_path / "run"), "--device", "cpu", "--compile"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"flashfsdp-train: error: --compile: torch.compile does not work on this machine ({reason}); "
                     "run without --compile"]
    assert not (tmp_path / "run").exists()
