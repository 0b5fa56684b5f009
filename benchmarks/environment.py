"""Where and with what a benchmark ran: the device, torch and Triton versions and the date, stamped
on every result row (:meth:`Environment.stamp`), and the results folder's name for the device
(:attr:`Environment.slug`)."""

from __future__ import annotations

import datetime
import platform
import re
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Environment:
    """Where and with what a benchmark ran; :meth:`stamp` gives the columns every row carries."""

    device_type: str  # "cuda" or "cpu"
    device_name: str  # e.g. "NVIDIA H100 80GB HBM3", "cpu (AMD EPYC, 2 threads)"
    slug: str  # results folder name: "nvidia-h100-80gb-hbm3", "cpu"
    torch_version: str
    triton_version: str
    date: str  # UTC, ISO 8601, seconds

    def stamp(self) -> dict[str, str]:
        """The per-row columns: device, torch, triton, date."""
        return {"device": self.device_name, "torch": self.torch_version, "triton": self.triton_version,
                "date": self.date}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def slugify(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_setup(device_name: str) -> "tuple[torch.device, Environment, str]":
    """(device, :func:`environment` of it, the process-group backend) for ``--device cuda|cpu``."""
    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    return device, environment(device), "nccl" if device.type == "cuda" else "gloo"


def environment(device: torch.device) -> Environment:
    """Describe ``device`` and the software versions now. CPU results all go to the ``cpu`` folder."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - missing or broken Triton
        triton_version = "unavailable"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        slug = slugify(name)
    else:
        threads = torch.get_num_threads()
        name = f"cpu ({_cpu_model()}, {threads} thread{'' if threads == 1 else 's'})"
        slug = "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    return Environment(device.type, name, slug, torch.__version__, triton_version, date)


def environment_columns() -> list[str]:
    """Names of the columns :meth:`Environment.stamp` adds, for column lists."""
    return list(Environment("", "", "", "", "", "").stamp())
