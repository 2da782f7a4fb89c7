"""Run first by every Python a peer starts (this folder leads its PYTHONPATH, `peers.run_as_env`)
while threefold runs the CPU as a lesser class ($THREEFOLD_CPU_CLASS=avx2).

The environment caps torch's own kernels (ATen, oneDNN, MKL) for peers as for us, but torch
sends bf16 matmuls to oneDNN by CPUID (below: not on AVX2), and vLLM
CPU picks its compiled kernels (`vllm._C` for AVX512-BF16, `_C_AVX512`, `_C_AVX2`) and its
attention paths from torch.cpu's CPUID probes, which no environment variable moves. On an
AVX-512 machine that measures vLLM's AVX-512 build against our AVX2 one, so the probes answer
for the class run as. Nothing changes without the variable.
"""

from __future__ import annotations

import os

if os.environ.get("THREEFOLD_CPU_CLASS") == "avx2":
    import torch.backends.mkldnn
    import torch.cpu

    # What threefold.cpu.apply_run_as does in our process: bf16 matmuls take ATen's gemm, as on
    # an AVX2 CPU, whose CPUID fails torch's oneDNN-bf16 check.
    torch.backends.mkldnn.set_flags(False)

    def _absent() -> bool:
        return False

    for _probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                   "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, _probe):
            setattr(torch.cpu, _probe, _absent)
