"""What `flashfsdp-train` shows and writes on rank 0: progress bar, metrics, summary, plot, samples.

Run directory files: `metrics.jsonl` (one JSON object per training step or validation),
`summary.json`, `loss.png` (train/validation loss curves) and `samples.txt`; with
--tensorboard / --wandb the same records also go to `flashfsdp.train.loggers`' sinks.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys

from tqdm import tqdm

from flashfsdp.estimate import estimate
from flashfsdp.log import get_logger
from flashfsdp.runtime.memory import PeakMemoryMeter
from flashfsdp.train.config import load_saved_config
from flashfsdp.train.flops import format_mfu
from flashfsdp.train.loggers import TENSORBOARD_DIR, Sink

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
PLOT = "loss.png"
SAMPLES = "samples.txt"
_log = get_logger(__name__)


def format_bytes(n: float) -> str:
    """Human-readable size with binary prefixes, e.g. 1.5GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def reset(out: str) -> None:
    """Remove the report files of an earlier, checkpoint-less start in `out` (a fresh run)."""
    for name in (METRICS, SUMMARY, PLOT, SAMPLES):
        path = os.path.join(out, name)
        if os.path.exists(path):
            os.remove(path)
    shutil.rmtree(os.path.join(out, TENSORBOARD_DIR), ignore_errors=True)


class Progress:
    """A tqdm bar over optimizer steps (rank 0 only; other ranks get a no-op bar) plus
    `metrics.jsonl` appends, each record also given to the `sinks` (TensorBoard, W&B). Records
    are dicts with a "step" key (steps completed)."""

    def __init__(self, out: str, total: int, initial: int, enabled: bool,
                 sinks: list[Sink] | None = None):
        self.enabled = enabled
        self.sinks = list(sinks or []) if enabled else []
        self.path = os.path.join(out, METRICS)
        self.bar = tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                        dynamic_ncols=True, file=sys.stderr)
        self.postfix: dict[str, str] = {}

    def log(self, record: dict) -> None:
        """Append a record to metrics.jsonl and give it to the sinks (rank 0)."""
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
            for sink in self.sinks:
                sink.log(record)

    def step(self, record: dict, memory: PeakMemoryMeter) -> None:
        """Log a training step and advance the bar with loss, tokens/s per rank, MFU, step time
        and peak memory."""
        self.log(record)
        self.postfix.update(loss=f"{record['train_loss']:.3f}", lr=f"{record['lr']:.1e}",
                            tok_s_rank=f"{record['tokens_per_s_per_rank']:.0f}",
                            mfu=format_mfu(record["mfu"]), ms=f"{record['step_ms']:.0f}",
                            mem=format_bytes(memory.peak_bytes(sync=False)))
        self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.update(1)

    def validation(self, step: int, val_loss: float, **extra) -> None:
        """Log a validation loss and show it on the bar."""
        self.log({"step": step, "val_loss": val_loss, **extra})
        self.postfix["val"] = f"{val_loss:.3f}"
        self.bar.set_postfix(self.postfix)

    def close(self) -> None:
        """Close the bar (records can still be logged afterwards)."""
        self.bar.close()

    def close_sinks(self) -> None:
        """Close the sinks (flush TensorBoard's events, finish the W&B run); none is used after."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()


def resume_steps(out: str) -> list[int]:
    """The steps at which the run in `out` was resumed (its validation records marked "resumed")."""
    path = os.path.join(out, METRICS)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return sorted({rec["step"] for rec in map(json.loads, fh) if rec.get("resumed")})


def read_metrics(out: str) -> tuple[dict[int, dict], dict[int, float]]:
    """Train records and validation losses by step from metrics.jsonl; for a step logged twice
    (a resumed run redoing steps after its last checkpoint) the later record wins."""
    train, val = {}, {}
    path = os.path.join(out, METRICS)
    if not os.path.exists(path):
        return train, val
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            if "train_loss" in rec:
                train[rec["step"]] = rec
            if "val_loss" in rec:
                val[rec["step"]] = rec["val_loss"]
    return train, val


def plot_losses(out: str, unigram: float) -> str | None:
    """Write loss.png (train and validation loss against step, unigram baseline dashed, a dotted
    line where each resumption began).

    Returns the path, or None with a one-line warning when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log.warning("matplotlib is not installed; no loss.png (pip install 'flashfsdp[train]')")
        return None
    train, val = read_metrics(out)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = sorted(train)
    ax.plot(steps, [train[s]["train_loss"] for s in steps], lw=0.8, alpha=0.8, label="train")
    vsteps = sorted(val)
    ax.plot(vsteps, [val[s] for s in vsteps], "o-", ms=4, label="validation")
    ax.axhline(unigram, ls="--", color="gray", label=f"unigram baseline ({unigram:.2f})")
    for i, step in enumerate(resume_steps(out)):
        ax.axvline(step, ls=":", color="black", alpha=0.6, label="resumed" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(f"flashfsdp-train: {os.path.basename(out)}")
    ax.grid(alpha=0.3)
    ax.legend()
    path = os.path.join(out, PLOT)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_summary(out: str, summary: dict) -> str:
    """Write summary.json and return the printable summary table."""
    with open(os.path.join(out, SUMMARY), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
    unit = summary.get("unit", "byte")
    rows = [
        ("parameters", f"{summary['params'] / 1e6:.2f}M"),
        ("ranks", f"{summary['world_size']} ({summary['device']})"),
        ("steps", _steps(summary)),
        ("final train loss", _nats(summary["train_loss"], unit)),
        ("final val loss", _nats(summary["val_loss"], unit)),
        ("unigram baseline", _nats(summary["unigram_baseline"], unit)),
        ("tokens/s", _beside_segment(summary, _throughput, "tokens_per_s")),
        *([("model TFLOP/s per rank", _beside_segment(summary, _tflops, "tflops_per_rank"))]
          if "tflops_per_rank" in summary else []),
        *([("fp16 steps skipped", f"{summary['overflow_steps']} (gradient overflow)")]
          if summary.get("overflow_steps") is not None else []),
        *([("trainable / frozen", _frozen(summary))] if "frozen_params" in summary else []),
        *([("interrupted", summary["interrupted"])] if summary.get("interrupted") else []),
        ("wall time", _wall_time(summary)),
        ("peak memory/rank", _peak_memory(out, summary)),
        ("run directory", out),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line] + [f"{k:<{width}} | {v}" for k, v in rows] + [line])


def estimated_memory(out: str, world_size: int) -> int | None:
    """`flashfsdp.estimate`'s bytes per rank (model states and the step's peak, activations
    excluded) for the run whose config is `<out>/run.json`; None if there is none."""
    try:
        config = load_saved_config(out)
    except FileNotFoundError:
        return None
    return estimate(config.llama, world_size, mp_policy=config.precision.policy,
                    reshard_after_forward=config.sharding.reshard_after_forward).total_bytes


def _peak_memory(out: str, summary: dict) -> str:
    """The measured peak, what it measured, and beside it `flashfsdp.estimate`'s bytes (which
    leave activations out)."""
    text = format_bytes(summary["peak_memory_bytes"])
    if summary.get("peak_memory_what"):
        text += f" measured ({summary['peak_memory_what']})"
    est = estimated_memory(out, summary["world_size"])
    if est is not None:
        text += (f"; flashfsdp.estimate: {format_bytes(est)} for parameters, gradients, optimizer states "
                 "and gathered units, activations not counted")
    return text


def _frozen(summary: dict) -> str:
    """"0.52M / 0.27M parameters (saves ~3.1MiB per rank of gradients and AdamW state)"."""
    return (f"{summary['trainable_params'] / 1e6:.2f}M / {summary['frozen_params'] / 1e6:.2f}M parameters "
            f"(saves ~{format_bytes(summary['frozen_saved_bytes_per_rank'])} per rank of gradients and "
            "AdamW state)")


def whole_run(out: str, start_step: int) -> dict:
    """{"run": the figures of every segment's steps} for a resumed run (`start_step` > 0), from
    metrics.jsonl (a redone step's later record; each segment's first step left out as warm-up,
    as the segment's own figures do): its first step, the steps timed, the seconds in them, and
    tokens/s, per rank, model TFLOP/s per rank and MFU over that time; {} for a run's first segment."""
    train, _ = read_metrics(out)
    starts = {0, *resume_steps(out), start_step}
    timed = [rec for step, rec in train.items() if step - 1 not in starts] or list(train.values())
    seconds = sum(rec["step_ms"] for rec in timed) / 1000
    if start_step == 0 or seconds <= 0:
        return {}

    def over_time(key: str) -> float | None:
        values = [(rec.get(key), rec["step_ms"] / 1000) for rec in timed]
        return None if any(v is None for v, _ in values) else sum(v * dt for v, dt in values) / seconds

    return {"run": {"start_step": 0, "steps_timed": len(timed), "step_s": seconds,
                    **{key: over_time(key) for key in ("tokens_per_s", "tokens_per_s_per_rank",
                                                       "tflops_per_rank", "mfu")}}}


def saved_losses(extra: dict) -> str:
    """A checkpoint's losses (its `extra`) as text: "train loss 2.5203, val loss not measured at that step"."""
    def loss(value: float | None) -> str:
        return "not measured at that step" if value is None else f"{value:.4f}"

    return f"train loss {loss(extra.get('train_loss'))}, val loss {loss(extra.get('val_loss'))}"


def _steps(summary: dict) -> str:
    """"0 -> 100 (this segment: 98 -> 100)" after a resume, else "0 -> 100"."""
    segment = f"{summary['start_step']} -> {summary['step']}"
    run = summary.get("run")
    return segment if not run else f"{run['start_step']} -> {summary['step']} (this segment: {segment})"


def _beside_segment(summary: dict, figure, key: str) -> str:
    """`figure` of the whole run, the segment's beside it, after a resume (where the run's records
    carry `key`); else the segment's."""
    run = summary.get("run")
    if not run or run.get(key) is None:
        return figure(summary)
    return f"{figure(run)} over the run; this segment {figure(summary)}"


def _tflops(summary: dict) -> str:
    """"0.0155 (MFU n/a)"."""
    return f"{summary['tflops_per_rank']:.3g} (MFU {format_mfu(summary.get('mfu'))})"


def _wall_time(summary: dict) -> str:
    """"16.1 s", or after a resume "16.1 s this segment; 80.2 s in the run's timed steps"."""
    run = summary.get("run")
    wall = f"{summary['wall_s']:.1f} s"
    return wall if not run else f"{wall} this segment; {run['step_s']:.1f} s in the run's timed steps"


def _nats(x: float | None, unit: str = "byte") -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.4f} nats/{unit} ({x / math.log(2):.3f} bits)"


def _throughput(summary: dict) -> str:
    """"11300 (5650 per rank)", or the total alone for a summary without the per-rank figure."""
    total = f"{summary['tokens_per_s']:.0f}"
    per_rank = summary.get("tokens_per_s_per_rank")
    return total if per_rank is None else f"{total} ({per_rank:.0f} per rank)"


def write_samples(out: str, prompt: str, samples: list[str]) -> str:
    """Write samples.txt and return it as text to print."""
    text = "".join(f"--- sample {i + 1} (prompt {prompt!r}) ---\n{s}\n" for i, s in enumerate(samples))
    with open(os.path.join(out, SAMPLES), "w", encoding="utf-8") as fh:
        fh.write(text)
    return text
