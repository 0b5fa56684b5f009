"""The command lines of `flashfsdp-train` and `flashfsdp-train export`: argparse parsers whose
training options are generated from the configuration's sections (`flashfsdp_cli.train_sections`).

Standard library only (see `flashfsdp_cli`): `flashfsdp.train.config.TrainConfig` resolves what
`parse_options` returns; the model presets themselves are `flashfsdp.models.PRESETS`.
"""

from __future__ import annotations

import argparse
import textwrap

from flashfsdp_cli.config_fields import add_options
from flashfsdp_cli.train_sections import (  # noqa: F401 - re-exported: the command line's names
    DEFAULT_TIMEOUT_S, DTYPE_ALIASES, DTYPE_NAMES, PRESET_TRAINING, SECTIONS, check_log_ranks, check_values)

PROG = "flashfsdp-train"
EXPORT_PROG = f"{PROG} export"
# Where a run goes without --out (`runs/<preset>-<time>`), and where export looks without --out.
RUNS = "runs"

_COMMANDS = f"""commands:
  {PROG} [options]
      train (the options above)
  {EXPORT_PROG} --out RUN --to DIR [--step N]
      a run's checkpoint as a transformers LlamaForCausalLM folder; without --out, the
      newest run under {RUNS}/ (see {EXPORT_PROG} --help)
"""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block); exit code 2."""

    def error(self, message: str):
        """Exit with code 2 and `prog: error: message (see --help)` on stderr."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `flashfsdp-train` argument parser: --config, then one group per configuration section
    (`flashfsdp_cli.train_sections.SECTIONS`); each option's destination is its dotted key
    ("model.seq_len") and reads None when not given (`TrainConfig` resolves the defaults)."""
    p = Parser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_COMMANDS,
        description=textwrap.fill(
            "Train a byte-level Llama-style language model sharded with flashfsdp, or fine-tune a "
            "transformers Llama (--init-from). Every option below is also a key of a --config TOML "
            "file, in the table of its group: [model] seq_len = 256.", 78),
    )
    p.add_argument("--config", metavar="FILE.toml",
                   help="a TOML file of option values, one table per group below ([model], [training], "
                        "...), keys as the options' names with '_'; options given on the command line "
                        "override it")
    add_options(p, SECTIONS)
    return p


def parse_options(argv: list[str]) -> tuple[str | None, dict]:
    """(--config's path or None, the other options' values by dotted key, None where not given)
    of the `flashfsdp-train` command line `argv`.

    Raises:
        SystemExit: --help (code 0), or an argparse error (code 2, one line on stderr).
    """
    values = vars(build_parser().parse_args(argv))
    return values.pop("config"), values


def build_export_parser() -> argparse.ArgumentParser:
    """The `flashfsdp-train export` argument parser."""
    parser = Parser(prog=EXPORT_PROG, description="Convert a run's newest checkpoint into a Hugging Face "
                                                  "LlamaForCausalLM folder (config.json + model.safetensors, "
                                                  "and the run's tokenizer).")
    parser.add_argument("--out", metavar="RUN", help=f"the run directory (flashfsdp-train --out; default: the "
                                                      f"newest run under {RUNS}/, the last one started or resumed)")
    parser.add_argument("--to", metavar="DIR", required=True, help="the folder to write (created)")
    parser.add_argument("--step", type=int, metavar="N", help="the checkpoint after N steps (default: the newest)")
    return parser
