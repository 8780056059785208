"""Devices: what a GPU can do, from its datasheet, to plan for it without one.

A profile made on fake tensors runs nothing, so its node times come from a roofline: each
operator takes the longer of its FLOPs at the device's peak rate for its math and the bytes
it reads and writes at the device's memory bandwidth. The table also holds what the planner
needs beside the profile: memory per device, the host link that swapping uses and the link
between stage devices, so that ``--devices 8xA100-40GB`` says everything. Figures are the
vendor's datasheet peaks (dense math, one direction of a link); sources in
``docs/paper-scale.md``.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from lightning_pipe.units import parse_bytes

__all__ = ["DEVICES", "DeviceSpec", "Math", "parse_devices"]

#: The kinds of math a GPU has peak rates for: FP32 on CUDA cores, and TF32, BF16 and FP16
#: on tensor cores.
Math = Literal["fp32", "tf32", "bf16", "fp16"]

_G, _T = 1e9, 1e12


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU model's peak rates and sizes.

    Attributes:
        memory: bytes of device memory.
        flops: peak FLOP/s by math (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``); a GPU
            without tensor cores for a kind lacks its entry.
        memory_bandwidth: bytes/s between device memory and the chip.
        host_bandwidth: bytes/s to host memory, one direction (swap).
        link_bandwidth: bytes/s to another device of the node, one direction.
        cuda: a CUDA GPU, whose ``scaled_dot_product_attention`` runs a fused kernel
            (:mod:`lightning_pipe.measure.attention`); a fake profile for it runs that one.
    """

    name: str
    memory: int
    flops: Mapping[Math, float]
    memory_bandwidth: float
    host_bandwidth: float
    link_bandwidth: float
    cuda: bool = True

    def peak_flops(self, math: Math) -> float:
        """FLOP/s for ``math``; math the GPU has no tensor cores for runs at the FP32 rate."""
        return self.flops.get(math, self.flops["fp32"])

    def roofline_ms(self, flops: float, nbytes: float, math: Math = "fp32") -> float:
        """Milliseconds of an operator doing ``flops`` and moving ``nbytes`` to and from
        device memory: bound by whichever takes longer."""
        return 1e3 * max(flops / self.peak_flops(math), nbytes / self.memory_bandwidth)


# SXM modules. V100: NVLink 300 GB/s and PCIe Gen3 32 GB/s are both directions together;
# A100: NVLink 600 GB/s, PCIe Gen4 64 GB/s; H100: NVLink 900 GB/s, PCIe Gen5 128 GB/s, and
# its tensor core rates are printed with sparsity, twice the dense ones given here.
DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec("V100-32GB", 32 * 2**30, {"fp32": 15.7 * _T, "fp16": 125 * _T}, 900 * _G, 16 * _G, 150 * _G),
        DeviceSpec("A100-40GB", 40 * 2**30, {"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
                   1555 * _G, 32 * _G, 300 * _G),
        DeviceSpec("A100-80GB", 80 * 2**30, {"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
                   2039 * _G, 32 * _G, 300 * _G),
        DeviceSpec("H100-80GB", 80 * 2**30,
                   {"fp32": 67 * _T, "tf32": 494.5 * _T, "bf16": 989.5 * _T, "fp16": 989.5 * _T},
                   3350 * _G, 64 * _G, 450 * _G),
    )
}


def parse_devices(text: str) -> tuple[DeviceSpec, int] | None:
    """``"8xA100-40GB"``: the spec and the count; ``None`` if ``text`` names no device (a
    memory size such as ``"4x16GiB"``).

    Raises:
        ValueError: a ``COUNTxNAME`` whose name is neither a device nor a memory size.
    """
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\S+)\s*", text)
    if match is None:
        return None
    count, name = int(match.group(1)), match.group(2)
    spec = {n.lower(): s for n, s in DEVICES.items()}.get(name.lower())
    if spec is not None:
        return spec, count
    try:
        parse_bytes(name)
    except ValueError:
        raise ValueError(
            f"unknown device {name!r} in {text!r}: give one of {', '.join(DEVICES)} (e.g. 8xA100-40GB), "
            f"or a memory size per device such as 4x16GiB."
        ) from None
    return None
