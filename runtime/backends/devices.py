"""Target devices: their published figures (`onepass plan` reads them) and the TensorRT builder's workspace budget
for plans built for them (`onepass build-trt --device`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    """Published figures of a target; ``usable_fraction`` of memory is left to onepass."""

    name: str
    memory_gib: float
    bandwidth_gbs: float
    fp16_tflops: float  # dense tensor-core FP16/BF16
    int8_tops: float  # dense tensor-core INT8
    fp32_tflops: float  # FP32 on the CUDA cores (what an fp32 plan or pass without TF32 gets)
    usable_fraction: float
    workspace_mib: int  # TensorRT builder workspace limit for plans built for this device
    note: str


DEVICES = {
    # fp32: CUDA cores x 2 FLOP x boost clock (Orin Nano 1,024 x 625 MHz, NX 1,024 x 918 MHz, AGX 2,048 x 1.3 GHz;
    # H200: NVIDIA's 67 TFLOPS FP64/FP32 vector figure, not the TF32 tensor-core one)
    "orin-nano-8gb": Device("Jetson Orin Nano 8GB", 8, 68, 10, 20, 1.28, 0.6, 256,
                            "memory shared with the OS and CPU; 40 sparse INT8 TOPS -> 20 dense"),
    "orin-nx-16gb": Device("Jetson Orin NX 16GB", 16, 102, 25, 50, 1.88, 0.7, 512,
                           "memory shared with the OS and CPU; 100 sparse TOPS incl. DLA; GPU dense assumed"),
    "agx-orin-64gb": Device("Jetson AGX Orin 64GB", 64, 204.8, 42, 85, 5.3, 0.75, 2048,
                            "memory shared with the OS and CPU; 275 sparse TOPS incl. DLA; GPU dense assumed"),
    "h200": Device("NVIDIA H200 SXM 141GB", 141, 4800, 989, 1979, 67, 0.9, 8192, "HBM3e; dense tensor-core figures"),
}
