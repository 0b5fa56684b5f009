"""One worker (rank) of `flashfsdp-train`: the `Trainer` and the sharded training loop.

Every rank builds the model on the meta device, shards it (one unit per block plus the root),
materialises only its shards and initialises them from the run's seed (or loads a checkpoint
into them), and steps AdamW on its shards; rank r trains on its B/W rows of each global batch
(`flashfsdp.train.data.batch_loader`: a `DataLoader` over a `DistributedSampler`); with
--tp the W ranks form a (W/tp, tp) mesh and the rows are dealt out by data-parallel rank. The
learning rate is a pure function of the step (`flashfsdp.train.lr_schedule.lr_at`), so a
checkpoint plus the step number restores data order and schedule at any world size. Ctrl-C and
SIGTERM: see [Note: stop signals] in `flashfsdp.train.stopping`.
"""

from __future__ import annotations

import gc
import itertools
import signal
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flashfsdp import ShardedGradScaler
from flashfsdp.debug import report_failure, set_step, set_trace_dir
from flashfsdp.log import get_logger
from flashfsdp.runtime.memory import PeakMemoryMeter
from flashfsdp.train import report
from flashfsdp.train.checkpoints import clear_stop_record, load_checkpoint, record_stop, save_checkpoint
from flashfsdp.train.data import Corpus, batch_loader, load_corpus, unigram_entropy
from flashfsdp.train.flops import Throughput, device_peak_flops, flops_per_token
from flashfsdp.train.freezing import FreezeSummary, freeze
from flashfsdp.train.launch import agree_run_dir, init_distributed, run_id
from flashfsdp.train.lr_schedule import lr_at
from flashfsdp.train.loggers import open_sinks
from flashfsdp.train.pretrained import load_pretrained
from flashfsdp.train.run_file import describe_changes
from flashfsdp.train.run_lock import hold_on_rank0
from flashfsdp.train.precision import Precision
from flashfsdp.train.sharding import build_mesh, build_sharded_model, clip_grad_norm, data_parallel
from flashfsdp.train.stopping import StopFlag, exit_code
from flashfsdp.train.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from flashfsdp.train.config import TrainConfig

SAMPLE_COUNT = 3
SAMPLE_TEMPERATURE = 0.8
# Seed offset of the validation windows: fixed, so every evaluation scores the same windows.
VAL_SEED_OFFSET = 1
# AdamW's betas and epsilon (as GPT-3 and Llama).
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
_log = get_logger(__name__)


def build_optimizer(model: torch.nn.Module, no_decay: frozenset[str], weight_decay: float,
                    lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the parameters not named in `no_decay` (the RMSNorm weights);
    frozen parameters (requires_grad False: --freeze) are left out, and so is an empty group.

    Args:
        model: the sharded model.
        no_decay: names (as in `model.named_parameters()`) that take no weight decay.
        weight_decay: decay of the other parameters.
        lr: initial learning rate (the trainer sets each step's own).
    """
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trained if n not in no_decay]
    rest = [p for n, p in trained if n in no_decay]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS)


def build_grad_scaler(precision: Precision, device: torch.device) -> ShardedGradScaler:
    """`flashfsdp.ShardedGradScaler` with torch's defaults (initial scale 2**16, halved after an
    overflow, doubled after 2000 clean steps), enabled when the run computes or reduces in
    float16 (`Precision.loss_scaling`); else disabled (its `step` just steps the optimizer)."""
    return ShardedGradScaler(device.type, enabled=precision.loss_scaling)


class Trainer:
    """One rank's training job: the sharded model, its optimizer, data samplers and run state.

    Collective: every rank of the (initialised) process group builds one and calls the same
    methods in the same order. Construction builds and initialises the model (or loads the
    checkpoint `resume_from`, or the --init-from weights), freezes the --freeze parameters; on a
    fresh run rank 0 writes the run config and clears the report files of an earlier
    checkpoint-less start, on a resumed one it records the resumption in run.json and clears the
    stop record (`<out>/stopped.json`).

    Args:
        config: the run's config.
        corpus: the token corpus (`flashfsdp.train.data.load_corpus` with the run's tokenizer).
        rank, world_size: this rank and the number of ranks.
        device: this rank's device.
        stop: the SIGINT / SIGTERM flag read at the end of each step (None: never stops early).
        resume_from: checkpoint to continue from (None: a fresh run initialised from the seed);
            given exactly when `config.checkpoint.resume`.

    Raises:
        ValueError: `resume_from` given without `config.checkpoint.resume`, or missing with it.

    Attributes:
        step: optimizer steps done.
        train_loss: mean training loss of the last step (nats/byte), or None.
        val_loss, val_step: the last validation loss and the step it was measured after.
    """

    def __init__(self, config: TrainConfig, corpus: Corpus, rank: int, world_size: int,
                 device: torch.device, stop: StopFlag | None = None, resume_from: str | None = None):
        if config.checkpoint.resume != (resume_from is not None):
            raise ValueError(
                f"Trainer: resume_from={resume_from!r} does not match config.checkpoint.resume="
                f"{config.checkpoint.resume}; "
                "pass the checkpoint to continue from exactly when resuming "
                "(flashfsdp.train.checks.check_out finds it)")
        self._t_start = time.perf_counter()
        # The rank's peak memory from here on: the model (only shards: built on the meta device),
        # optimizer state, activations; not the interpreter and torch themselves (on CPU).
        # A first reset returns the allocator's free pages (e.g. a tokenizer's temporaries) to the
        # OS, so that the RSS the meter starts from is what the process holds, not what it freed.
        PeakMemoryMeter(device).reset()
        self.memory = PeakMemoryMeter(device)
        self.memory.reset()
        self.config, self.corpus = config, corpus
        self.rank, self.world_size, self.device, self.stop = rank, world_size, device, stop
        self.model_config = config.llama
        seq_len = self.model_config.max_seq_len
        self.unigram = unigram_entropy(corpus.train)
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        training = config.training
        # --tp: a (dp, tp) mesh; the ranks of one TP group read the same rows of each batch
        self.mesh = build_mesh(device.type, world_size, config.sharding.tp)
        self.dp_rank, self.dp_size = data_parallel(self.mesh, rank, world_size)
        self.micro_batch = training.batch_size // self.dp_size // training.grad_accum
        self.tokens_per_step = training.batch_size * seq_len
        self.throughput = Throughput(self.tokens_per_step, world_size,
                                     flops_per_token(self.model_config, seq_len),
                                     device_peak_flops(device, config.sharding.param_dtype,
                                                       config.logging.peak_tflops))
        self.model, no_decay = self._build(resume_from)
        self.frozen: FreezeSummary = freeze(self.model, config.model.freeze, self.model_config)
        self.optimizer = build_optimizer(self.model, no_decay, config.optimizer.weight_decay, config.optimizer.lr)
        self.scaler = build_grad_scaler(config.precision, device)
        self.step, self.saved_extra = 0, {}
        self.resumed = resume_from is not None
        if self.resumed:
            state = load_checkpoint(resume_from, self.model, self.optimizer)
            self.step, self.saved_extra = state["step"], state.get("extra") or {}
            if self.saved_extra.get("grad_scaler"):
                self.scaler.load_state_dict(self.saved_extra["grad_scaler"])
        if rank == 0:
            self._record_start()
        dist.barrier()
        self.start_step = self.step
        self._train_batches = iter(self._loader(corpus.train, training.seed, self.step))
        # fp16: optimizer steps skipped because a gradient overflowed (over the whole run)
        self.overflow_steps = self.saved_extra.get("overflow_steps", 0)
        self.train_loss = self.saved_extra.get("train_loss")
        self.val_loss, self.val_step = None, None
        self.last_saved = self.step if self.resumed else None
        self.step_times: list[float] = []

    def _build(self, resume_from: str | None) -> tuple[torch.nn.Module, frozenset[str]]:
        """The sharded model (`build_sharded_model`), initialised from the seed, or left for the
        checkpoint `resume_from`, or loaded from --init-from unit by unit (`load_pretrained`)."""
        c, init_from = self.config, self.config.model.init_from
        fresh_init = resume_from is None and init_from is None
        model, no_decay = build_sharded_model(
            self.model_config, self.device, c.precision.policy, seed=c.training.seed if fresh_init else None,
            activation_checkpointing=c.training.activation_checkpointing, compiled=c.training.compile,
            reshard_after_forward=c.sharding.reshard_after_forward, mesh=self.mesh)
        if resume_from is None and init_from is not None:
            load_pretrained(model, init_from, self.model_config)
        return model, no_decay

    def _record_start(self) -> None:
        """Rank 0: a fresh run writes run.json and clears an earlier start's reports; a resumed
        one appends the resumption to run.json and clears the stop record."""
        c = self.config
        if not self.resumed:
            c.save()
            report.reset(c.run.out)
            return
        changed = c.record_resumption(self.step, self.world_size)["changed"]
        clear_stop_record(c.run.out)
        if changed:
            _log.info("resumed with %s", describe_changes(changed))

    def _loader(self, data: torch.Tensor, seed: int, start_step: int):
        """This rank's batches of `data` from `start_step` on (`flashfsdp.train.data.batch_loader`)."""
        return batch_loader(data, self.model_config.max_seq_len, self.config.training.batch_size,
                            self.dp_size, self.dp_rank, seed, start_step,
                            pin_memory=self.device.type == "cuda")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based) on the run's schedule."""
        o = self.config.optimizer
        return lr_at(step, o.lr, o.warmup, o.decay_steps, o.min_lr)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats) of int64 (b, T) inputs x and targets y."""
        logits = self.model(x.to(self.device))
        return F.cross_entropy(logits.float().flatten(0, 1), y.to(self.device).flatten())

    def train_step(self) -> tuple[dict, bool]:
        """One optimizer step on this rank's rows of global batch `self.step`, in `grad_accum`
        micro-batches (gradients reduced after the last one), clipped, then AdamW. The ranks
        all-reduce the loss together with their stop flags.

        Returns:
            (the step's metrics record: step, train_loss, lr, grad_norm, step_ms, tokens_per_s,
            tokens_per_s_per_rank, tflops_per_rank, mfu (None without a peak: see
            `flashfsdp.train.flops`), world_size, and in fp16 skipped and loss_scale; whether
            any rank asked to stop).
        """
        t0 = time.perf_counter()
        set_step(self.step + 1)  # the flight recorder's step: this training step's number
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y = next(self._train_batches)
        accum = self.config.training.grad_accum
        loss_sum = torch.zeros((), device=self.device)
        for i, (xs, ys) in enumerate(zip(x.split(self.micro_batch), y.split(self.micro_batch))):
            self.model.set_requires_gradient_sync(i == accum - 1)
            loss = self._loss(xs, ys) / accum
            self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        grad_norm, skipped = self._optimizer_step()
        stop = float(self.stop.requested) if self.stop is not None else 0.0
        stats = torch.stack((loss_sum.float(), torch.tensor(stop, device=self.device)))
        # mean loss for the bar (the ranks of a TP group hold the same loss: still the mean over the
        # data-parallel ranks), and the stop flags of all ranks
        dist.all_reduce(stats)
        self.step += 1
        self.train_loss = float(stats[0]) / self.world_size
        dt = time.perf_counter() - t0
        self.step_times.append(dt)
        record = {"step": self.step, "train_loss": self.train_loss, "lr": lr,
                  "grad_norm": grad_norm, "step_ms": 1000 * dt, **self.throughput.rates(dt),
                  "world_size": self.world_size}
        if self.scaler.is_enabled():
            record.update(skipped=skipped, loss_scale=self.scaler.get_scale())
        return record, float(stats[1]) > 0

    def _optimizer_step(self) -> tuple[float, bool]:
        """Unscale (fp16), clip, step AdamW unless a gradient overflowed, update the loss scale,
        zero the gradients. Returns (the global gradient norm, whether the step was skipped)."""
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(self.model, self.config.optimizer.max_grad_norm, self.mesh is not None)
        skipped_before = self.scaler.steps_skipped
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        skipped = self.scaler.steps_skipped > skipped_before
        self.overflow_steps += skipped
        return grad_norm, skipped

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss (nats/byte) over the same `eval_batches` global batches, all
        ranks; also recorded as `val_loss` after `step`."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # (sum of row losses, rows)
        val = self._loader(self.corpus.val, self.config.training.seed + VAL_SEED_OFFSET, 0)
        for x, y in itertools.islice(val, self.config.eval.eval_batches):
            for xs, ys in zip(x.split(self.micro_batch), y.split(self.micro_batch)):
                total[0] += self._loss(xs, ys).double() * xs.shape[0]
                total[1] += xs.shape[0]
        dist.all_reduce(total)
        self.val_loss, self.val_step = float(total[0] / total[1]), self.step
        return self.val_loss

    def save(self) -> str:
        """Checkpoint after `step` steps (collective), with the losses and the data and
        schedule state in its `extra`; keeps the `keep_checkpoints` newest. Returns its path."""
        c = self.config
        extra = {"train_loss": self.train_loss,
                 "val_loss": self.val_loss if self.val_step == self.step else None,
                 "lr": self.lr_at(max(self.step - 1, 0)), "world_size": self.world_size,
                 "seed": c.training.seed, "batch_size": c.training.batch_size, "next_step": self.step,
                 "overflow_steps": self.overflow_steps}
        if self.scaler.is_enabled():
            extra["grad_scaler"] = self.scaler.state_dict()
        path = save_checkpoint(c.run.out, self.model, self.optimizer, self.step, extra,
                               c.checkpoint.keep_checkpoints, self.rank)
        self.last_saved = self.step
        return path

    def sample(self) -> list[str]:
        """`SAMPLE_COUNT` continuations of the prompt, `sample_tokens` tokens each (collective:
        every rank runs the same forwards; the same seed gives the same text)."""
        ids = self.tokenizer.encode(self.config.eval.prompt) or self.tokenizer.encode("\n")
        start = torch.tensor([ids] * SAMPLE_COUNT, dtype=torch.long, device=self.device)
        gen = torch.Generator().manual_seed(self.config.training.seed)
        out = self.model.generate(start, self.config.eval.sample_tokens, temperature=SAMPLE_TEMPERATURE,
                                  generator=gen)
        return [self.tokenizer.decode(row.tolist()) for row in out.cpu()]

    def train(self) -> int:
        """Train to `steps` (validating every `eval_every`, saving every `save_every` and at the
        end), then write the summary, loss plot and samples. The summary's wall time counts
        from the construction (model build and checkpoint load included).

        Returns:
            The process exit code: 0, or 128 + the signal after a SIGINT / SIGTERM (the
            checkpoint of the last step done is saved first: `_stop`).
        """
        c = self.config
        log = c.logging
        sinks = open_sinks(c.run.out, log.tensorboard, log.wandb, c.sections()) if self.rank == 0 else []
        progress = report.Progress(c.run.out, c.training.steps, self.start_step, enabled=self.rank == 0, sinks=sinks)
        try:
            return self._train(progress)
        finally:
            progress.close_sinks()

    def _train(self, progress: report.Progress) -> int:
        """`train` with its progress bar and metric sinks open."""
        _log.info(self._header())
        set_step(self.step)  # (evaluation batches are not steps)
        if self.config.model.freeze:
            f = self.frozen
            _log.info("--freeze: training %.2fM parameters, %.2fM frozen (%d tensors); about %s per rank "
                      "of gradients and AdamW state not allocated", f.trainable / 1e6, f.frozen / 1e6,
                      len(f.frozen_tensors), report.format_bytes(f.saved_bytes_per_rank(self.world_size)))
        self.evaluate()
        if self.resumed:
            _log.info("resumed from step %d of %s: val loss %.4f (at the save: %s)", self.start_step,
                      self.config.run.out, self.val_loss, report.saved_losses(self.saved_extra))
        progress.validation(self.step, self.val_loss, resumed=self.resumed,
                            world_size=self.world_size)
        try:
            interrupted = self._run_steps(progress)
        finally:
            progress.close()
        if interrupted:
            return self._stop(time.perf_counter() - self._t_start)
        if self.val_step != self.step:
            progress.validation(self.step, self.evaluate())
        if self.last_saved != self.step:
            self._save_final()
        self._finish(time.perf_counter() - self._t_start)
        return 0

    def _run_steps(self, progress: report.Progress) -> bool:
        """Steps until `steps` or a stop request; returns True if stopped early."""
        steps, every = self.config.training.steps, self.config.eval.eval_every
        save_every = self.config.checkpoint.save_every
        if self._stop_agreed():
            _log.info("interrupted before the first step of this run (step %d)", self.step)
            return True
        while self.step < steps:
            record, stop = self.train_step()
            progress.step(record, self.memory)
            if stop:
                _log.info("interrupted: saving a checkpoint at step %d", self.step)
                return True
            if self.step % every == 0 or self.step == steps:
                progress.validation(self.step, self.evaluate())
            if self.step % save_every == 0 and self.step < steps:
                self.save()
        return False

    def _save_final(self) -> None:
        """`save`, and log the checkpoint's path."""
        _log.info("checkpoint %s", self.save())

    def _stop_agreed(self) -> bool:
        """Whether any rank's stop flag is set (collective: every rank gets the same answer)."""
        flag = float(self.stop is not None and self.stop.requested)
        flag = torch.tensor(flag, device=self.device)
        dist.all_reduce(flag)
        return float(flag) > 0

    def _stop(self, wall_s: float) -> int:
        """After the ranks agreed to stop on a signal ([Note: stop signals] in
        `flashfsdp.train.stopping`): save the checkpoint of the last step done unless it is on
        disk (a fresh run stopped before its first step has nothing to save), record it in
        `<out>/stopped.json` for the launcher, write the summary and loss plot of the steps done
        (no samples), and return the exit code: 128 + this rank's signal (SIGTERM when the signal
        reached only other ranks)."""
        if self.step > self.start_step and self.last_saved != self.step:
            self._save_final()
        signum = self.stop.signum or signal.SIGTERM
        if self.last_saved == self.step:
            if self.rank == 0:
                record_stop(self.config.run.out, self.step, run_id(), signal.Signals(signum).name)
            dist.barrier()  # no rank exits (and has the agent stop the others) before the record
        if self.rank == 0 and self.step > self.start_step:
            self._write_reports(wall_s, interrupted=f"{signal.Signals(signum).name} at step {self.step}")
        return exit_code(signum)

    def _header(self) -> str:
        """The first line of the run: model size, ranks, corpus and unigram baseline."""
        corpus = self.corpus
        unit = corpus.unit
        return (f"{self.model_config.num_params() / 1e6:.2f}M parameters, "
                f"{self.world_size} rank(s){self._layout()} on {self.device.type}, corpus {corpus.source}: "
                f"{corpus.train.numel() / 1e6:.1f}M {unit}s train ({corpus.train_files} files), "
                f"{corpus.val.numel() / 1e6:.2f}M {unit}s val ({corpus.val_files} files), "
                f"unigram baseline {self.unigram:.3f} nats/{unit}")

    def _layout(self) -> str:
        """" as (dp, tp) = (2, 2)" with --tp, else nothing."""
        tp = self.config.sharding.tp
        return f" as (dp, tp) = ({self.dp_size}, {tp})" if tp > 1 else ""

    def _finish(self, wall_s: float) -> None:
        """Samples (all ranks), then on rank 0 the summary, loss plot and samples files."""
        samples = self.sample() if self.config.eval.sample_tokens > 0 else []
        if self.rank != 0:
            return
        self._write_reports(wall_s)
        if samples:
            print(report.write_samples(self.config.run.out, self.config.eval.prompt, samples), flush=True)

    def _write_reports(self, wall_s: float, interrupted: str | None = None) -> None:
        """Rank 0: summary.json and its table on stdout, and loss.png (`interrupted`: the signal
        and step of an early stop, shown in the summary)."""
        out = self.config.run.out
        timed = self.step_times[1:] or self.step_times  # the first step includes warm-up costs
        summary = {
            "params": self.model_config.num_params(), "world_size": self.world_size,
            "device": self.device.type, "start_step": self.start_step, "step": self.step,
            "train_loss": self.train_loss, "val_loss": self.val_loss,
            "unigram_baseline": self.unigram,
            **(self.throughput.rates(sum(timed), len(timed)) if timed else {"tokens_per_s": 0.0}),
            "unit": self.corpus.unit,
            "wall_s": wall_s, "peak_memory_bytes": self.memory.peak_bytes(),
            "peak_memory_what": self.memory.description,
            "overflow_steps": self.overflow_steps if self.scaler.is_enabled() else None,
            "interrupted": interrupted, **report.whole_run(out, self.start_step),
            **({"trainable_params": self.frozen.trainable, "frozen_params": self.frozen.frozen,
                "frozen_saved_bytes_per_rank": self.frozen.saved_bytes_per_rank(self.world_size)}
               if self.config.model.freeze else {}),
        }
        print(report.write_summary(out, summary), flush=True)
        report.plot_losses(out, self.unigram)


def run_worker(config: TrainConfig, corpus: Corpus | None = None,
               resume_from: str | None = None, hold_lock: bool = False) -> int:
    """Train as one rank of the job torchrun / elastic started; returns the process exit code.

    Args:
        config: the run's config.
        corpus: the corpus if already loaded (by the checks), else it is loaded here.
        resume_from: the checkpoint to continue from (found by the checks), or None.
        hold_lock: rank 0 takes the run directory's lock for the run (under a user's torchrun;
            `flashfsdp-train`'s own launcher holds it for its workers). Held elsewhere: every
            rank returns 2, rank 0 naming the holder.
    """
    rank, world_size, device = init_distributed(config.run.device, config.run.timeout)
    stop = StopFlag()
    config, resume_from = agree_run_dir(config, resume_from)
    # After StopFlag's handlers: a SIGTERM dumps the flight recorder, then stops the run as before.
    set_trace_dir(config.run.out)
    if corpus is None:
        corpus = load_corpus(config.data.path, seed=config.training.seed,
                             tokenizer=load_tokenizer(config.data.tokenizer))
    lock = hold_on_rank0(config.run.out, rank) if hold_lock else None
    try:
        if lock is not None and not lock.held:
            return 2
        return Trainer(config, corpus, rank, world_size, device, stop, resume_from).train()
    except Exception as exc:
        report_failure(exc)  # said and dumped now: a SIGTERM during the cleanup below could cut it short
        raise
    finally:
        if lock is not None:
            lock.release()
        set_trace_dir(None)
        stop.restore()
        gc.collect()  # the model (cycles holding communicators and work handles) before its process group
        dist.destroy_process_group()
