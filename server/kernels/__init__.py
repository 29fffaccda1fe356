"""Device fast paths and their pure-torch reference twins. Imports torch only.

Modules (import them directly; each fast op has a same-signature twin named `*_reference` beside it):
- capabilities: `capabilities(device)` probes once per process which fast paths work here, with reasons.
  `with_fallback` runs a fast path, or its reference once the fast one has raised here (one warning).
- compat: public `F.*` vs private `torch._*` spellings of scaled_mm / grouped_mm / scaled_grouped_mm;
  `synchronize(device)`.
- fp8: `quantize_fp8_rowwise`, `quantize_activation`, `fp8_linear`, `Fp8Linear`, `blockwise_to_rowwise`.
- moe / moe_fp8: `route_softmax`, `route_sigmoid_bias`, `moe_experts`, `moe_experts_fp8`, `quantize_experts`.
- sampling: `SamplingRow`, `build_sampling_batch`, `sample` (sync-free, seeded exponential race).
- streams: `DeviceStreams.copy_to_host(t) -> PendingCopy`, non-blocking device-to-host copies.
"""
