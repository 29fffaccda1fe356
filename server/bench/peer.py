"""The transformers peer: the same weights in Hugging Face transformers, run in its best mode.

Best mode: on CUDA a static cache, which makes generate() torch.compile the decode step (inductor,
reduce-overhead: CUDA graphs); for MoE models the grouped_mm experts can be kept during decode (generate()
would switch them to batched_mm, which measures slower compiled). Elsewhere eager with the default dynamic
cache (eager static-cache decode measures slower). The bench falls back to eager where compiling fails.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from server.bench.measure import Rates, Series, first_line, measure_series, total_weight_bytes
from server.bench.presets import Target
from server.bench.random_model import copy_our_weights_into

log = logging.getLogger(__name__)

NEVER_PRODUCED_ID = 10**9  # eos id outside every vocabulary: generation always runs to max_new_tokens


@dataclass
class PeerMode:
    static_compile: bool  # static cache + generate()'s auto torch.compile
    keep_grouped_experts: bool  # override generate()'s grouped_mm -> batched_mm switch in decode

    def describe(self, is_moe: bool) -> str:
        text = "eager, dynamic cache"
        if self.static_compile:
            text = "static cache + torch.compile (transformers auto-compile)"
        if is_moe:
            experts = "grouped_mm kept in decode" if self.keep_grouped_experts else "transformers default experts"
            text += f", {experts}"
        return text


def build_peer_from_preset(hf_config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """transformers' model of the same config with exactly our random weights (regenerated on the device)."""
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    kept = copy_our_weights_into(model, hf_config, dtype, seed)
    if kept:
        log.info("transformers buffers kept as computed: %s", ", ".join(kept))
    return model.eval()


def build_peer_from_checkpoint(model_dir: Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=str(device))
    except (ImportError, ValueError) as exc:  # device_map may need accelerate on some versions
        log.info("from_pretrained(device_map=%s) failed (%s); loading on the CPU, then moving", device, exc)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    return model.eval()


def best_modes(device: torch.device, is_moe: bool, peer_experts: str) -> list[PeerMode]:
    """The modes to measure (the fastest is reported)."""
    if device.type != "cuda":
        return [PeerMode(static_compile=False, keep_grouped_experts=False)]
    if not is_moe or peer_experts == "transformers-default":
        return [PeerMode(True, False)]
    if peer_experts == "best":
        return [PeerMode(True, True), PeerMode(True, False)]
    return [PeerMode(True, True)]


class TransformersPeer:
    def __init__(self, model: nn.Module, mode: PeerMode, max_len: int):
        self.model, self.mode, self.max_len = model, mode, max_len
        self.device = next(model.parameters()).device
        self.set_mode(mode)

    def set_mode(self, mode: PeerMode) -> None:
        self.mode = mode
        if mode.keep_grouped_experts:
            self.model._optimize_model_for_decode = contextlib.nullcontext  # per instance: other models keep it
        else:
            self.model.__dict__.pop("_optimize_model_for_decode", None)

    def generation_config(self, num_new: int):
        config = copy.deepcopy(self.model.generation_config)
        config.max_new_tokens, config.min_new_tokens = num_new, None
        config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
        config.eos_token_id, config.pad_token_id = NEVER_PRODUCED_ID, 0
        if self.mode.static_compile:
            config.cache_implementation, config.disable_compile = "static", False
            if hasattr(config, "max_cache_len"):  # one cache length for every call: no recompiles between lengths
                config.max_cache_len = self.max_len
        else:
            config.cache_implementation = None
            config.disable_compile = True
        return config

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], num_new: int) -> list[list[int]]:
        input_ids = torch.tensor(prompts, dtype=torch.long, device=self.device)  # [B, prompt_len], no padding
        out = self.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=self.generation_config(num_new)
        )
        return out[:, input_ids.shape[1]:].tolist()

    @property
    def compiled(self) -> bool:
        """Whether transformers holds a compiled forward (always False in the eager modes)."""
        return (getattr(self.model, "_compiled_call", None) is not None) if self.mode.static_compile else False


def transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def peer_series(opts, target: Target, device, dtype, prompts, lengths, is_moe: bool, progress) -> Series:
    series = Series()
    progress.set_description("peer: building transformers model")
    too_big = _peer_does_not_fit(target, device, dtype)
    if too_big:
        series.notes.append(too_big)
        progress.write(too_big)
        return series
    try:
        if target.model_dir is not None:
            model = build_peer_from_checkpoint(target.model_dir, device, dtype)
        else:
            model = build_peer_from_preset(target.hf_config, device, dtype, opts.seed)
    except Exception as exc:  # report what we measured of ours even when transformers cannot run the model
        series.notes.append(f"transformers could not build the model: {type(exc).__name__}: {exc}")
        progress.write(series.notes[-1])
        return series
    if opts.quantize != ("none",):
        series.notes.append(f"the peer runs unquantized {str(dtype).removeprefix('torch.')}")
    max_len = max(len(p[0]) for p in prompts.values()) + lengths[1] + 1
    modes = best_modes(device, is_moe, opts.peer_experts)
    peer = TransformersPeer(model, modes[0], max_len)
    for batch in prompts.values():
        try:
            modes = _measure_peer_batch(series, peer, modes, is_moe, device, batch, lengths, opts.reps, progress)
        except Exception as exc:  # e.g. out of memory at a large batch: keep the other batch sizes
            series.notes.append(f"transformers failed at batch {len(batch)}: {type(exc).__name__}: {first_line(exc)}")
            progress.write(series.notes[-1])
    return series


def _peer_does_not_fit(target: Target, device, dtype) -> str | None:
    """Why transformers' unquantized model cannot be built on this device, or None (checked up front: an 80B
    model's out-of-memory error takes a minute to reach)."""
    if device.type != "cuda":
        return None
    from server.bench.random_model import empty_model

    needed = total_weight_bytes(empty_model(target.hf_config, "meta", dtype))
    free, _total = torch.cuda.mem_get_info(device)
    if needed <= 0.95 * free:
        return None
    return (f"transformers not measured: its {str(dtype).removeprefix('torch.')} weights need "
            f"{needed / 1e9:.1f} GB and the device has {free / 1e9:.1f} GB free (one GPU; transformers would need "
            "a device_map over several)")


def _measure_peer_batch(series: Series, peer, modes: list, is_moe: bool, device, batch, lengths, reps,
                        progress) -> list:
    """Measure each candidate mode at this batch size and keep the fastest; returns the modes still usable."""
    best: tuple[Rates, list[int], str] | None = None
    for mode in list(modes):
        peer.set_mode(mode)
        trial = Series()
        try:
            measure_series(trial, "peer", peer.generate, device, batch, lengths, reps, progress)
        except Exception as exc:
            if not mode.static_compile:
                raise
            series.notes.append(f"compile failed ({type(exc).__name__}: {first_line(exc)}); measured eager")
            progress.write(f"transformers: {series.notes[-1]}")
            torch.compiler.reset()
            modes = [PeerMode(False, mode.keep_grouped_experts)]
            peer.set_mode(modes[0])
            measure_series(trial, "peer", peer.generate, device, batch, lengths, reps, progress)
        rates = trial.rates[len(batch)]
        if best is None or rates.decode_tok_s > best[0].decode_tok_s:
            described = peer.mode.describe(is_moe)
            if peer.mode.static_compile and peer.compiled is False:
                described += " (transformers did not compile it)"
            best = (rates, trial.tokens[len(batch)], described)
        if not peer.mode.static_compile and mode.static_compile:
            break  # compiling failed: the other candidate modes would compile too
    series.rates[len(batch)], series.tokens[len(batch)], series.modes[len(batch)] = best
    return modes
