"""The compile wing's process-wide settings (server/compile/knobs.py)."""

from __future__ import annotations

import torch

from server.compile import knobs
from server.kernels import fp8
from server.models.affine_quant import AffineFormat, AffineLinear


def test_cuda_compiles_tune_block_sizes_for_models_with_packed_weights_only():
    """Inductor's coordinate descent tuning: on for CUDA compiles of a model with FP8 linears or packed int4 / int8
    weights, off for one without, untouched on other devices (their kernels have no such tuner)."""
    import torch._inductor.config as inductor_config

    fp8_model = torch.nn.Sequential(fp8.Fp8Linear(16, 8), torch.nn.Linear(8, 8))
    int4_model = torch.nn.Sequential(AffineLinear(64, 8, AffineFormat(64, 4), torch.bfloat16))
    bf16_model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    assert knobs.has_packed_weights(fp8_model) and knobs.has_packed_weights(int4_model)
    assert not knobs.has_packed_weights(bf16_model)
    with inductor_config.patch(coordinate_descent_tuning=False):  # restores the setting after (monkeypatch hides it)
        knobs.tune_generated_kernels(torch.device("cpu"), True)
        assert inductor_config.coordinate_descent_tuning is False
        for model, tuned in ((fp8_model, True), (bf16_model, False), (int4_model, True)):
            knobs.tune_generated_kernels(torch.device("cuda"), knobs.has_packed_weights(model))
            assert inductor_config.coordinate_descent_tuning is tuned
