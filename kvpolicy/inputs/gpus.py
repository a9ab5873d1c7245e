"""GPU specifications and detection through nvidia-smi."""

from __future__ import annotations

import functools
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvpolicy import new_list
from kvpolicy.errors import InputError

Generation = Literal["ampere", "ada", "hopper", "blackwell", "cdna3", "cdna4"]


class GpuSpec(BaseModel):
    """One GPU model as the rules see it."""

    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    id: str
    """Catalog id, e.g. `h100-sxm`."""
    name: str
    """Marketing name as nvidia-smi prints it, e.g. `NVIDIA H100 80GB HBM3`."""
    aliases: list[str] = Field(default_factory=new_list)
    """Other names accepted on the command line (`h100`, `H100-SXM`)."""
    vendor: Literal["nvidia", "amd"] = "nvidia"
    """Vendor."""
    generation: Generation
    """Architecture generation; thresholds such as break-even are keyed by it."""
    compute_capability: str | None = None
    """CUDA compute capability, e.g. `9.0`; None for AMD."""
    memory_gib: float = Field(gt=0)
    """Device memory as the driver reports it, in GiB."""
    bandwidth_tbs: float = Field(gt=0)
    """Peak memory bandwidth in TB/s."""
    fp8_compute: bool
    """FP8 tensor cores exist (SM89+); without them FP8 is storage only."""
    fp8_formats: list[str] = Field(default_factory=new_list)
    """FP8 encodings the tensor cores take (e4m3, e5m2, e4m3fnuz...)."""
    num_sms: int | None = Field(default=None, gt=0)
    """Streaming multiprocessors (compute units on AMD)."""
    bf16_dense_tflops: float | None = Field(default=None, gt=0)
    """Dense BF16 tensor-core peak in TFLOPS (no sparsity); the prefill model of `kvpolicy plan` reads it."""
    source: str = ""
    """Where the numbers come from."""

    @property
    def sm(self) -> int | None:
        """Compute capability as an integer (9.0 -> 90)."""
        return _sm(self.compute_capability)


@functools.cache
def _sm(compute_capability: str | None) -> int | None:
    # Read dozens of times per decision: parsed once per distinct string.
    if not compute_capability:
        return None
    major, minor = compute_capability.split(".")
    return int(major) * 10 + int(minor)


def detect_gpu_names() -> list[str]:
    """Names of the local GPUs from nvidia-smi; raises InputError where there is none."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise InputError(
            "--gpu auto: nvidia-smi was not found, so no GPU can be detected on this machine. "
            "Name the target GPU instead, e.g. `--gpu h100` (see `kvpolicy gpus`)."
        )
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        raise InputError(
            f"--gpu auto: nvidia-smi failed ({exc}). Name the target GPU instead, e.g. `--gpu h100`."
        ) from None
    names = [line.strip() for line in out.splitlines() if line.strip()]
    if not names:
        raise InputError("--gpu auto: nvidia-smi lists no GPU. Name the target GPU instead, e.g. `--gpu h100`.")
    return names
