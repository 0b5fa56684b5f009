"""`flashfsdp-train export [--out RUN] --to DIR [--step N]`: a run's newest checkpoint (or step N's)
as a Hugging Face `LlamaForCausalLM` folder (`config.json` + `model.safetensors`, the run's
tokenizer: `tokenizer.json` + `tokenizer_config.json`, and its special tokens: beginning / end of
sequence in all three and `generation_config.json`, `flashfsdp.train.hf_special`) that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load.
Without --out it exports the newest run under `runs/` (where `flashfsdp-train` puts a run without
--out, as `runs/<preset>-<time>`): the one started or resumed last.

The run's model is rebuilt from its `run.json` the way `--resume` rebuilds it (preset, overrides,
tokenizer vocabulary, or --init-from's config), loaded on this one process from the checkpoint
(`flashfsdp.checkpoint.load` reshards any world size to 1), and renamed to transformers' Llama
names (`flashfsdp.train.hf_names`).

Nothing else changes: every weight is written as it is, and `flashfsdp.models.Llama` computes
what transformers' Llama computes with the same fp32 ops in the same order (the half-split rotary
layout of `rotate_half`, its rotary frequencies, SDPA with the same scale, causal flag and grouped
heads), so the exported model's fp32 logits are the job's model's bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from flashfsdp import checkpoint
from flashfsdp.bindings.state_dict import SINGLE_FILE, remove_stale_weights
from flashfsdp.models import Llama, LlamaConfig
from flashfsdp.train.checkpoints import checkpoint_dir, latest_checkpoint
from flashfsdp.train.config import PROG, RUN_CONFIG, RUNS, TrainConfig, UsageError
from flashfsdp.train.hf_names import hf_names
from flashfsdp.train.hf_special import SpecialTokens, special_tokens, write_generation_config
from flashfsdp.train.hf_tokenizer import run_tokenizer
from flashfsdp_cli.train_options import EXPORT_PROG, build_export_parser

COMMAND = EXPORT_PROG


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """`flashfsdp.models.Llama`'s state dict under transformers' `LlamaForCausalLM` names and layout
    (see the module docstring: renamed, not changed); `lm_head.weight` only when the embeddings are not tied.

    Raises:
        KeyError: an entry of the Llama state dict is missing (named).
    """
    out = {theirs: state_dict[ours] for ours, theirs in hf_names(config).items()}
    return {key: value.detach().contiguous() for key, value in out.items()}


def hf_config(config: LlamaConfig, transformers, special: SpecialTokens | None = None):
    """The `transformers.LlamaConfig` of the same model (fp32, no biases, SiLU, default rotary),
    with the special token ids of `special` (`flashfsdp.train.hf_special`; None: no ids)."""
    ids = {"bos_token_id": None, "eos_token_id": None, **(special.ids if special else {})}
    return transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_embeddings, attention_bias=False, mlp_bias=False, hidden_act="silu",
        architectures=["LlamaForCausalLM"], dtype="float32", **ids,
    )


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_export_parser().parse_args(argv)


def runs_under(parent: str) -> list[str]:
    """The run directories (holding a run.json) directly under `parent`, newest first: the one
    whose run.json was written last, at its start or its latest --resume."""
    if not os.path.isdir(parent):
        return []
    found = [os.path.join(parent, name) for name in os.listdir(parent)
             if os.path.isfile(os.path.join(parent, name, RUN_CONFIG))]
    return sorted(found, key=lambda run: os.path.getmtime(os.path.join(run, RUN_CONFIG)), reverse=True)


def _run_dir(given: str | None) -> str:
    """The run to export: --out, or without it the newest run under `runs/` (`runs_under`).

    Raises:
        UsageError: --out is not a run directory (naming the newest run beside it, where there
            is one), or there is no run under `runs/` to default to.
    """
    if given is None:
        newest = runs_under(RUNS)
        if not newest:
            raise UsageError(f"no --out and no {PROG} run under {os.path.abspath(RUNS)}; pass --out RUN")
        return os.path.abspath(newest[0])
    out = os.path.abspath(given)
    if not os.path.isfile(os.path.join(out, RUN_CONFIG)):
        beside = runs_under(os.path.dirname(out))
        fix = (f"its folder's newest run is {os.path.join(os.path.dirname(given), os.path.basename(beside[0]))}: "
               f"pass that (without --out: the newest run under {RUNS}/)" if beside else "pass the --out of a run")
        raise UsageError(f"--out {given}: not a {PROG} run directory (no {RUN_CONFIG}); {fix}")
    return out


def _checked(args: argparse.Namespace) -> tuple[str, str, str]:
    """(run, checkpoint, destination) as absolute paths, or UsageError naming the option."""
    out, to = _run_dir(args.out), os.path.abspath(args.to)
    named = args.out or os.path.relpath(out)
    if os.path.exists(to) and not os.path.isdir(to):
        raise UsageError(f"--to {args.to}: is a file; pass a directory")
    path = latest_checkpoint(out)
    if path is None:
        raise UsageError(f"--out {named}: the run has no complete checkpoint yet; train until one is saved "
                         f"(--save-every) and export again")
    if args.step is not None and not os.path.isdir(checkpoint_dir(out, args.step)):
        raise UsageError(f"--step {args.step}: the run has no checkpoint of that step (the newest is "
                         f"{os.path.basename(path)}); leave --step out for the newest")
    return out, path if args.step is None else checkpoint_dir(out, args.step), to


def _libraries():
    try:
        import safetensors.torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415
    except ImportError as exc:
        raise UsageError(f"export needs transformers >= 5 and safetensors ({exc}); "
                         f"pip install 'flashfsdp[hf]'") from None
    return transformers, safetensors.torch


def export(out: str, path: str, to: str) -> tuple[int, str]:
    """Write checkpoint ``path`` of run ``out`` into ``to`` as a transformers Llama folder, with the
    run's tokenizer (``hf_tokenizer.py``: ``AutoTokenizer.from_pretrained(to)`` gives the job's ids).

    Returns:
        (the checkpoint's step, the weights file written).

    Raises:
        UsageError: transformers or safetensors is missing; the run's model options are invalid.
        ValueError / OSError / RuntimeError: from ``flashfsdp.checkpoint.load`` (a damaged checkpoint).
    """
    transformers, st = _libraries()
    run = TrainConfig.from_argv(["--resume", "--out", out], warn=False)
    config = run.llama
    model = Llama(config)
    step = checkpoint.load(path, model)["step"]
    tensors = to_hf_state_dict(model.state_dict(), config)
    os.makedirs(to, exist_ok=True)
    remove_stale_weights(to, {SINGLE_FILE})
    special = special_tokens(run.data.tokenizer, run.model.init_from)
    hf_config(config, transformers, special).save_pretrained(to)
    run_tokenizer(run.data.tokenizer, transformers, special).save_pretrained(to)
    write_generation_config(special, to, transformers)
    weights = os.path.join(to, SINGLE_FILE)
    st.save_file(tensors, weights + ".tmp", metadata={"format": "pt"})
    os.replace(weights + ".tmp", weights)
    return step, weights


def main(argv: list[str]) -> int:
    """`flashfsdp-train export ARGS`; returns the exit code: 0 written, 2 bad input (one line on
    stderr naming the option and the fix; argparse errors exit through SystemExit(2))."""
    args = _parse(argv)
    path = args.out or RUNS
    try:
        out, path, to = _checked(args)
        step, weights = export(out, path, to)
    except UsageError as err:
        print(f"{COMMAND}: error: {err}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as err:
        print(f"{COMMAND}: error: checkpoint {path}: {err}".splitlines()[0], file=sys.stderr)
        return 2
    print(f"{COMMAND}: step {step} of {out} -> {weights} (+ config.json and the tokenizer)")
    return 0
