"""Byte-level text corpus and the deterministic per-rank batch sampler of `flashfsdp-train`.

Tokens are raw UTF-8 bytes (vocabulary 256). The default corpus is the Python standard library's
own `.py` sources, found through `sysconfig` (real text, ~10 MB, present wherever Python is).
The train/validation split is by file, so validation measures generalisation to unseen files.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sysconfig

import torch

# Directories of the standard library left out of the default corpus: third-party packages
# (not the standard library) and the large, repetitive test suites.
_EXCLUDED_STDLIB_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


class CorpusError(ValueError):
    """The corpus path is missing, holds no usable text, or is too small for the batches."""


@dataclasses.dataclass
class Corpus:
    """A byte corpus split into training and validation streams.

    Attributes:
        train: uint8 (n_train,) bytes of the training files, concatenated.
        val: uint8 (n_val,) bytes of the validation files, concatenated.
        train_files: number of files in `train` (1 when a single file was split by bytes).
        val_files: number of files in `val`.
        source: what was read (a path, or "Python standard library at ...").
    """

    train: torch.Tensor
    val: torch.Tensor
    train_files: int
    val_files: int
    source: str


def default_corpus_files() -> list[str]:
    """Sorted paths of the standard library's `.py` files (tests and site-packages excluded).

    The root is `sysconfig.get_paths()["stdlib"]` of the running interpreter.

    Raises:
        CorpusError: if no such file is found (a stripped Python install).
    """
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_STDLIB_DIRS]
        files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    if not files:
        raise CorpusError(
            f"no .py files under the standard library at {root}; give a corpus with --data PATH"
        )
    return sorted(files)


def _text_files(directory: str) -> list[str]:
    """Sorted regular files under `directory`, recursively, skipping hidden entries and caches."""
    files = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        files.extend(os.path.join(dirpath, f) for f in filenames if not f.startswith("."))
    return sorted(f for f in files if os.path.isfile(f))


def _read_utf8(path: str) -> bytes | None:
    """The file's bytes if they decode as UTF-8, else None (binary or other encodings)."""
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


def _to_tensor(chunks: list[bytes]) -> torch.Tensor:
    joined = b"".join(chunks)
    if not joined:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8)


def load_corpus(path: str | None = None, val_fraction: float = 0.05, seed: int = 0) -> Corpus:
    """Read a byte corpus and split it into train and validation streams.

    Sources:
        - None: the standard library's `.py` files (`default_corpus_files()`).
        - a directory: every regular file under it, recursively, that decodes as UTF-8
          (hidden files and directories and `__pycache__` are skipped; other files are ignored).
        - a file: that file, which must decode as UTF-8.

    Split: with several files, the sorted paths are shuffled by `random.Random(seed)` and whole
    files go to validation until it holds at least `val_fraction` of all bytes (at least one
    file, never all). A single file is split by bytes: its last `val_fraction` goes to
    validation. The result depends only on the files' contents, `val_fraction` and `seed`.

    Raises:
        CorpusError: missing path; no non-empty UTF-8 text; `val_fraction` outside (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise CorpusError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if path is None:
        files = default_corpus_files()
        source = f"Python standard library at {sysconfig.get_paths()['stdlib']}"
    elif os.path.isdir(path):
        files, source = _text_files(path), path
    elif os.path.isfile(path):
        files, source = [path], path
    else:
        raise CorpusError(
            f"--data PATH: no such file or directory: {path}; "
            "give a text file or a directory of text files"
        )
    texts = [t for t in map(_read_utf8, files) if t]
    if not texts:
        raise CorpusError(
            f"--data {source}: empty corpus (no non-empty UTF-8 text file found); "
            "give a text file or a directory of text files"
        )
    if len(texts) == 1:
        text = texts[0]
        n_val = max(1, int(len(text) * val_fraction))
        if n_val >= len(text):
            raise CorpusError(f"--data {source}: {len(text)} byte(s) is too little text to split")
        return Corpus(_to_tensor([text[:-n_val]]), _to_tensor([text[-n_val:]]), 1, 1, source)
    train_ids, val_ids = _split_files([len(t) for t in texts], val_fraction, seed)
    return Corpus(
        train=_to_tensor([texts[i] for i in train_ids]),
        val=_to_tensor([texts[i] for i in val_ids]),
        train_files=len(train_ids),
        val_files=len(val_ids),
        source=source,
    )


def _split_files(sizes: list[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, validation) file indices: the files shuffled by ``random.Random(seed)``, whole files
    to validation until it holds ``val_fraction`` of the bytes (at least one file, never all)."""
    order = list(range(len(sizes)))
    random.Random(seed).shuffle(order)
    target = val_fraction * sum(sizes)
    val_ids, val_bytes = [], 0
    for i in order[:-1]:
        if val_bytes >= target:
            break
        val_ids.append(i)
        val_bytes += sizes[i]
    val_set = set(val_ids)
    return [i for i in order if i not in val_set], val_ids


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy of the byte frequencies of `data`, in nats per byte.

    This is the cross-entropy of the best model that ignores context (predicts every byte from
    the corpus-wide histogram): the baseline a language model must beat.

    Args:
        data: uint8 (n,) bytes, n ≥ 1.
    """
    counts = torch.bincount(data.long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def _step_generator(seed: int, step: int) -> torch.Generator:
    """CPU generator seeded from (seed, step) alone, so any rank can rebuild any step."""
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) % (2**63)
    return torch.Generator(device="cpu").manual_seed(mixed)


class ShardedBatchSampler:
    """Deterministic, rank-disjoint random windows of `seq_len + 1` bytes for each step.

    For step s, one generator seeded by (seed, s) draws the GLOBAL batch of `global_batch`
    windows: a random shift in [0, seq_len] cuts the stream into aligned, non-overlapping
    windows of seq_len + 1 bytes after it, and `global_batch` distinct windows are picked at
    random. Rank r of W takes rows [r·B/W, (r+1)·B/W) of that global batch. So the windows of a
    step never overlap (within a rank or across ranks), and the global data order depends only
    on (seed, step): a run resumed at another world size sees exactly the same global batches.

    Args:
        data_len: bytes in the stream.
        seq_len: tokens per training sequence (inputs and targets are shifted by one byte).
        global_batch: sequences per step over all ranks (B).
        world_size: number of ranks (W); B must be divisible by W.
        rank: this rank, in [0, W).
        seed: data-order seed.

    Raises:
        ValueError: B not divisible by W, rank out of range, non-positive sizes, or a stream too
            short to hold B disjoint windows.
    """

    def __init__(self, data_len: int, seq_len: int, global_batch: int, world_size: int = 1,
                 rank: int = 0, seed: int = 0):
        if seq_len <= 0 or global_batch <= 0 or world_size <= 0:
            raise ValueError(
                f"seq_len ({seq_len}), global batch ({global_batch}) and world size "
                f"({world_size}) must be positive"
            )
        if global_batch % world_size:
            raise ValueError(
                f"global batch size {global_batch} is not divisible by the world size "
                f"{world_size}; use a --batch-size that is a multiple of {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        window = seq_len + 1
        capacity = (data_len - seq_len) // window  # windows available under the largest shift
        if capacity < global_batch:
            raise CorpusError(
                f"{data_len} bytes hold only {max(capacity, 0)} disjoint windows of "
                f"{window} bytes, fewer than the global batch of {global_batch}; use a smaller "
                "--batch-size or --seq-len, or more text"
            )
        self.data_len, self.seq_len, self.global_batch = data_len, seq_len, global_batch
        self.world_size, self.rank, self.seed = world_size, rank, seed

    @property
    def local_batch(self) -> int:
        """Rows per rank per step: global_batch // world_size."""
        return self.global_batch // self.world_size

    def global_offsets(self, step: int) -> torch.Tensor:
        """int64 (global_batch,) start offsets of step `step`'s windows, all ranks together."""
        gen = _step_generator(self.seed, step)
        window = self.seq_len + 1
        shift = int(torch.randint(0, window, (1,), generator=gen))
        n_windows = (self.data_len - shift) // window
        picks = torch.randperm(n_windows, generator=gen)[: self.global_batch]
        return shift + picks * window

    def offsets(self, step: int) -> torch.Tensor:
        """int64 (local_batch,) start offsets of this rank's rows of step `step`."""
        lo = self.rank * self.local_batch
        return self.global_offsets(step)[lo: lo + self.local_batch]

    def batch(self, data: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) for step `step`.

        Args:
            data: uint8 (data_len,) byte stream this sampler was built for.

        Returns:
            Two int64 tensors of shape (local_batch, seq_len) on `data`'s device; targets are
            the inputs shifted left by one byte.
        """
        if data.numel() != self.data_len:
            raise ValueError(f"data has {data.numel()} bytes, the sampler was built for {self.data_len}")
        index = self.offsets(step)[:, None] + torch.arange(self.seq_len + 1)
        rows = data[index.to(data.device)].long()
        return rows[:, :-1], rows[:, 1:]

