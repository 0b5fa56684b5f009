"""`flashfsdp-train`: train a byte-level Llama-style language model, sharded with flashfsdp.

    flashfsdp-train --preset tiny --steps 300            # 2 CPU workers, Python stdlib corpus
    flashfsdp-train --preset 1b --data corpus/ --out runs/1b
    flashfsdp-train --out runs/1b --resume --nproc 4     # continue at another number of ranks
    torchrun --nproc-per-node 8 -m flashfsdp.train --preset 1b

An application built on the library, one concern per module, each setting flowing one way from
the command line to the runtime:

- `cli`: the entry point `main` (after `flashfsdp_cli.train`, which checks the command line
  before torch is imported): config, the run directory's lock, checks, then launch the workers
  or train as one;
- `config`: the frozen `TrainConfig` built once from the command line, one section of each
  kind (`flashfsdp_cli.train_sections`: typed dataclasses whose fields generate the options and
  the TOML keys; the parser: `flashfsdp_cli.train_options`);
- `config_file`: --config FILE.toml, one table per section, read and checked by
  `flashfsdp_cli.config_file` before torch is imported (the flat keys of old files still load,
  with a deprecation notice); `run_file`: run.json, the resolved sections and the run's
  resumptions (an old flat run.json still resumes);
- `precision`: the dtype names parsed into torch dtypes, once, and the run's one
  `MixedPrecisionPolicy`;
- `errors`: `UsageError`, bad input (one line, exit code 2);
- `checks`: what is refused before any worker starts (batch split, memory fit, data, run dir);
- `launch`: starting the workers (torch elastic), joining the process group (with the
  collective timeout), Ctrl-C;
- `rendezvous`: the launcher's rendezvous, its stores listening on 127.0.0.1 only;
- `run_lock`: one run per output folder (an exclusive lock on `<out>/run.lock`);
- `hf_config` / `hf_names` / `pretrained`: --init-from, a transformers Llama folder's config,
  names and weights, loaded unit by unit; `freezing`: --freeze;
- `export` / `hf_tokenizer` / `hf_special`: `flashfsdp-train export`, a run as a transformers
  folder with its tokenizer and special tokens (without --out: the newest run under runs/);
- `trainer`: `Trainer` (train_step, evaluate, save, train) and `run_worker`, one rank's job;
- `sharding`: the meta-device build, sharding (--reshard-after-forward) and gradient clipping
  through flashfsdp;
- `activation_checkpointing`: --activation-checkpointing, torch's checkpoint wrapper per block;
- `checkpoints`: the run directory's checkpoints: naming, finding, saving, rotation;
- `data`: the corpus, its split, and the per-rank batches through `torch.utils.data`;
- `sources`: the documents of --data (text files, directories, `datasets` folders);
- `tokenizer`: UTF-8 bytes, or a tokenizer.json (--tokenizer);
- `lr_schedule`: warm-up then cosine decay, a pure function of the step;
- `report`: progress bar, metrics, summary, loss plot and samples on rank 0;
- `loggers`: TensorBoard and Weights & Biases sinks of the metrics (--tensorboard, --wandb);
- `flops`: model FLOPs per token, peak FLOP/s of known GPUs, MFU.

The command's entry point is `flashfsdp_cli.train.main` (`flashfsdp-train`, `python -m
flashfsdp.train`), which imports this package only after its own checks: this package does not
import it back.
"""
