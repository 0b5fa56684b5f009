"""--data sources beyond text files (a `datasets` save_to_disk folder) and --tokenizer (a
tokenizer.json of the `tokenizers` package): the corpus, the model's vocabulary, the errors."""

import sys
import math

import pytest
import torch

from flashfsdp.train.checks import check_data
from flashfsdp.train.config import TrainConfig, UsageError
from flashfsdp.train.data import CorpusError, load_corpus
from flashfsdp.train.tokenizer import ByteTokenizer, FileTokenizer, load_tokenizer

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n"


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 50, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 and tok.encode("é") == [0xC3, 0xA9] and tok.decode([0xC3, 0xA9]) == "é"
    assert tok.encode_docs([b"ab", b"c"]).tolist() == [97, 98, 99]


def test_tokenizer_json_encodes_the_corpus_and_sets_the_vocabulary(tmp_path, tokenizer_json):
    for i in range(6):
        (tmp_path / f"f{i}.py").write_text(TEXT * (i + 1))
    tok = load_tokenizer(tokenizer_json)
    assert isinstance(tok, FileTokenizer) and 256 < tok.vocab_size <= 300
    corpus = load_corpus(str(tmp_path), val_fraction=0.2, tokenizer=tok)
    assert corpus.train.dtype == torch.int32 and corpus.unit == "token"
    as_bytes = load_corpus(str(tmp_path), val_fraction=0.2)
    assert corpus.train.numel() < as_bytes.train.numel() / 2  # merges: fewer tokens than bytes
    assert tok.decode(corpus.val.tolist()) == bytes(as_bytes.val.tolist()).decode()  # same split
    assert int(corpus.train.max()) < tok.vocab_size
    config = TrainConfig.from_argv(["--tokenizer", tokenizer_json, "--out", str(tmp_path / "run")])
    assert config.llama.vocab_size == tok.vocab_size and config.data.tokenizer == tokenizer_json


def test_a_bad_tokenizer_file_is_named(tmp_path):
    pytest.importorskip("tokenizers")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match=rf"--tokenizer {bad}: not a readable tokenizer.json"):
        TrainConfig.from_argv(["--tokenizer", str(bad), "--out", str(tmp_path / "run")])


def _fake_datasets_folder(tmp_path):
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "state.json").write_text("{}")
    (folder / "dataset_info.json").write_text("{}")
    return folder


def test_a_datasets_folder_without_datasets_installed_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: its import fails
    folder = _fake_datasets_folder(tmp_path)
    with pytest.raises(UsageError, match=rf"--data {folder} is a folder saved by the datasets package; "
                                         r"reading it needs it: pip install datasets"):
        check_data(str(folder), 0, 16, 2, 1)


def _save(datasets, columns: dict, path) -> None:
    """`save_to_disk` of a Dataset of `columns` (built from an Arrow table with a given
    fingerprint: `from_dict` hashes its input with dill, which fails on some pyarrow builds)."""
    import pyarrow  # noqa: PLC0415 - a dependency of datasets
    from datasets.table import InMemoryTable  # noqa: PLC0415

    datasets.Dataset(InMemoryTable(pyarrow.table(columns)), fingerprint="test").save_to_disk(str(path))


def test_a_datasets_folder_is_read_by_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [f"row {i}: " + TEXT * (i % 3 + 1) for i in range(40)]
    _save(datasets, {"text": rows, "n": list(range(40))}, tmp_path / "ds")
    corpus = load_corpus(str(tmp_path / "ds"), val_fraction=0.1)
    assert corpus.train_files + corpus.val_files == 40
    assert corpus.train.numel() + corpus.val.numel() == sum(len(r.encode()) for r in rows)
    _save(datasets, {"text": rows[:20]}, tmp_path / "dict" / "train")
    _save(datasets, {"text": ["held out"] * 5}, tmp_path / "dict" / "test")
    (tmp_path / "dict" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    from_dict = load_corpus(str(tmp_path / "dict"), val_fraction=0.1)  # the "train" split only
    assert from_dict.train_files + from_dict.val_files == 20
    assert b"held out" not in bytes(torch.cat([from_dict.train, from_dict.val]).tolist())
    _save(datasets, {"body": rows}, tmp_path / "nocol")
    with pytest.raises(CorpusError, match="no 'text' column"):
        load_corpus(str(tmp_path / "nocol"))


def _train_with_tokenizer(rank: int, world_size: int, root: str, corpus: str, tokenizer: str) -> dict:
    from tests.train.trainers import make_trainer  # noqa: PLC0415

    trainer = make_trainer(["--data", corpus, "--tokenizer", tokenizer, "--steps", "2",
                            "--sample-tokens", "4", "--prompt", "def", "--out", f"{root}/run"])
    losses = [trainer.train_step()[0]["train_loss"] for _ in range(2)]
    return {"vocab": trainer.model.tok_embeddings.num_embeddings, "losses": losses,
            "samples": trainer.sample(), "unit": trainer.corpus.unit}


def test_the_trainer_trains_and_samples_with_a_tokenizer(tmp_path, tokenizer_json):
    from tests.harness import run_distributed  # noqa: PLC0415
    from tests.train.trainers import corpus_text  # noqa: PLC0415

    corpus = tmp_path / "corpus.py"
    corpus.write_text(corpus_text())
    vocab = load_tokenizer(tokenizer_json).vocab_size
    for got in run_distributed(_train_with_tokenizer, 2, str(tmp_path), str(corpus), tokenizer_json,
                               timeout=240):
        assert got["vocab"] == vocab and got["unit"] == "token"
        assert got["losses"][0] == pytest.approx(math.log(vocab), rel=0.05)  # a fresh model: uniform
        assert len(got["samples"]) == 3 and all(s.startswith("def") for s in got["samples"])
