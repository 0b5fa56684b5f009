"""How fast the command lines answer: `flashfsdp-train --help`, a usage error and an error in a
`--config` file (answered before torch is imported) against `python -m flashfsdp.train --help` (which imports the `flashfsdp`
package, and torch with it) and a bare `import torch`.

    python -m benchmarks.cli_timing [--repeats 5] [--record | --out DIR]

Each command runs `--repeats` times as a fresh process after one untimed warm-up run (the file
cache then holds torch); the table gives the median and range of the wall time. The console
script `flashfsdp-train` runs `flashfsdp_cli.train:main`, which is what the first rows time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.environment import environment
from benchmarks.outputs import add_output_arguments, output_dir
from benchmarks.tables import format_table, write_csv, write_markdown

COMMANDS = (
    ("flashfsdp-train --help", ["-m", "flashfsdp_cli.train", "--help"], 0),
    ("flashfsdp-train --steps 0 (usage error)", ["-m", "flashfsdp_cli.train", "--steps", "0"], 2),
    ("flashfsdp-train export --help", ["-m", "flashfsdp_cli.train", "export", "--help"], 0),
    ("flashfsdp-train --config bad.toml (config-file error)", ["-m", "flashfsdp_cli.train", "--config", "{bad_toml}"], 2),
    ("python -m flashfsdp.train --help", ["-m", "flashfsdp.train", "--help"], 0),
    ("python -c 'import torch'", ["-c", "import torch"], 0),
)
COLUMNS = ("command", "median_s", "min_s", "max_s", "runs")


def time_command(argv: list[str], expected: int, repeats: int) -> list[float]:
    """Wall seconds of `repeats` runs of `python argv` (after one untimed run).

    Raises:
        RuntimeError: a run exits with another code than `expected` (its stderr in the message).
    """
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
        elapsed = time.perf_counter() - start
        if done.returncode != expected:
            raise RuntimeError(f"{argv}: exit code {done.returncode}, expected {expected}: {done.stderr[-500:]}")
        if i:
            times.append(elapsed)
    return times


def main(argv: list[str] | None = None) -> int:
    """Time each command, print the table, write cli_timing.csv / .md."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cli_timing", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per command (default 5)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    env = environment(torch.device("cpu"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bad_toml = Path(tmp) / "bad.toml"
        bad_toml.write_text("[training]\nsteps = 'many'\n")  # a field of the wrong type
        times = [(name, time_command([a.format(bad_toml=bad_toml) for a in command], expected, args.repeats))
                 for name, command, expected in COMMANDS]
    for name, t in times:
        rows.append({"command": name, "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                     "runs": len(t), **env.stamp()})
    print(format_table(rows, COLUMNS))
    folder = output_dir(env.slug, out=args.out, record=args.record)
    write_csv(rows, folder / "cli_timing.csv")
    write_markdown(rows, COLUMNS, folder / "cli_timing.md", title="Command-line start-up (wall time per run)", env=env,
                   notes=["Each command a fresh process, after one untimed warm-up run; median, min and max of the "
                          "timed runs.", "`flashfsdp-train` answers --help, usage errors and --config file errors "
                          "before torch is imported; `python -m flashfsdp.train` imports the flashfsdp package, and torch, first."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
