"""Wiring an engine's step-level parts: load a checkpoint, size the KV cache and the hybrid state pool, build the
scheduler and the eager model runner. Plain functions from values to values; what compiles is server.compile's."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from server.config import EngineConfig
from server.engine import device as device_mod
from server.engine.block_allocator import BlockAllocator
from server.engine.kv_manager import KVManager
from server.engine.model_runner import KVCache, ModelRunner
from server.engine.prefix_disk import DiskIndex, DiskTier
from server.engine.prefix_store import PrefixStore, model_fingerprint, store_tensors
from server.engine.scheduler import Scheduler
from server.engine.state_cache import StateCache, state_pool, state_pool_bytes
from server.engine.tokenizer import Tokenizer
from server.engine.weights import load_model, read_config, resolve_model_path
from server.kernels.capabilities import Capabilities
from server.kernels.plan import StepPlans, build_step_plans, step_plans
from server.models.parallel import Layout

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    kv_cache: KVCache
    state_cache: StateCache | None  # hybrids only
    kv_manager: KVManager
    scheduler: Scheduler
    runner: ModelRunner  # the eager runner
    plans: StepPlans  # the forms of the engine's eager and compiled steps


def load_pretrained(config: EngineConfig, layout: Layout | None = None,
                    on_materialized: Callable[[torch.nn.Module, torch.device, torch.dtype, int], None] | None = None,
                    ) -> tuple[torch.nn.Module, Tokenizer, torch.device, torch.dtype, int]:
    """-> (model, tokenizer, device, dtype, max_model_len) of `config.load.model` (the demo, a path or a Hub id);
    under a parallel `layout`, this rank's part of the model. `on_materialized(model, device, dtype,
    max_model_len)` runs once the model's tensors hold their device memory, while its weights are still to load."""
    if config.load.model == "demo":
        from server.engine.demo import ensure_demo_model

        model_dir = ensure_demo_model()
    else:
        model_dir = resolve_model_path(config.load.model, config.load.revision)
    device, reason = device_mod.select_device(config.load.device)
    hf_config = read_config(model_dir)
    checkpoint_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
    dtype = device_mod.select_dtype(config.load.dtype, device, checkpoint_dtype)
    log.info("loading %s on %s (%s) as %s", config.load.model, device, reason, dtype)
    start = time.perf_counter()
    hook = None if on_materialized is None else (
        lambda model: on_materialized(model, device, dtype, serving_len(config, model)))
    model, _ = load_model(model_dir, device, dtype, config.load.quantization, layout, hook)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    log.info("weights loaded%s in %.1f s", " and quantized" if config.load.quantization else "", time.perf_counter() - start)
    return model, tokenizer, device, dtype, serving_len(config, model)


def serving_len(config: EngineConfig, model) -> int:
    """The longest sequence served: the configured length, at most the model's."""
    limit = int(getattr(model.args, "max_position_embeddings", None) or 4096)  # nested text_config resolved
    return min(config.scheduler.max_model_len or limit, limit)


def build_parts(model, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                max_model_len: int, agree_num_blocks: Callable[[int], int] | None = None,
                num_kv_blocks: int | None = None, plan_as: Capabilities | None = None) -> EngineParts:
    """`num_kv_blocks`: the paged KV's usable blocks, planned already (`plan_num_kv_blocks`, before the weights
    streamed in); `agree_num_blocks`: across the ranks of a parallel model, the block count all of them hold;
    `plan_as`: plan the steps as for the device those capabilities describe (the MPS audit runs the MPS plan on
    the CPU), not as the probe of `device` says."""
    if num_kv_blocks is None:
        num_kv_blocks = plan_num_kv_blocks(model, config, device, dtype, max_model_len)
    if agree_num_blocks is not None:
        num_kv_blocks = agree_num_blocks(num_kv_blocks)
    state_cache, state_slots = state_pool(
        state_specs(model), config.scheduler.max_num_seqs, config.cache.enable_prefix_caching, config.cache.block_size,
        dtype, device
    )
    # One more block than the budget's: block 0 is the scratch target of padded decode rows.
    kv_cache = KVCache(model.kv_cache_shapes(), num_kv_blocks + 1, config.cache.block_size, dtype, device)
    allocator = BlockAllocator(num_kv_blocks + 1, config.cache.block_size, config.cache.enable_prefix_caching,
                               num_reserved=1)
    kv_manager = KVManager(allocator, state_slots)
    limits = replace(config.scheduler, max_model_len=max_model_len)
    scheduler = Scheduler(limits, kv_manager)
    # the forms eager and compiled steps run (server.kernels.plan)
    plans = step_plans(device, dtype) if plan_as is None else build_step_plans(plan_as, plan_as.device, dtype)
    runner = ModelRunner(model, kv_cache, device, model.args.vocab_size, state_cache, plans)
    return EngineParts(kv_cache, state_cache, kv_manager, scheduler, runner, plans)


def attach_disk_tier(parts: EngineParts, model, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """With `prefix_cache_dir` set, a disk tier under the prefix cache, in a directory named by the model's
    fingerprint (prefix_store.model_fingerprint), so another model or build never reads its files."""
    cache = config.cache
    if cache.prefix_cache_dir is None or not cache.enable_prefix_caching:
        return
    fingerprint = model_fingerprint(model, dtype, config.load.quantization, cache.block_size, state_specs(model))
    state_layers = parts.state_cache.layers if parts.state_cache is not None else None
    store = PrefixStore(store_tensors(parts.kv_cache.layers, state_layers), fingerprint, device)
    root = Path(cache.prefix_cache_dir).expanduser() / fingerprint
    tier = DiskTier(DiskIndex(root, int(cache.prefix_cache_disk_gb * (1 << 30))), store)
    store.on_written = tier.written
    parts.kv_manager.attach_disk(tier)
    log.info("prefix cache disk tier: %s (%d files, %.2f of %g GB)", root, len(tier.index),
             tier.index.total_bytes / (1 << 30), cache.prefix_cache_disk_gb)


def plan_num_kv_blocks(model, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                       max_model_len: int) -> int:
    """The paged KV's usable blocks for `model`, whose weights hold their device memory already (loaded or not);
    the hybrids' state pool, not yet allocated, draws from the same budget."""
    state_bytes = state_pool_bytes(state_specs(model), config.scheduler.max_num_seqs,
                                   config.cache.enable_prefix_caching, config.cache.block_size, dtype)
    budget = kv_budget_bytes(config, device, state_bytes)
    # at least 1: a pipeline stage without attention layers holds no KV, only the block count every rank shares
    per_block = max(KVCache.bytes_per_block(model.kv_cache_shapes(), config.cache.block_size, dtype), 1)
    return num_kv_blocks(budget, per_block, config.cache.block_size, max_model_len, config.scheduler.max_num_seqs)


def state_specs(model):
    """A hybrid's per-sequence states (StateSpec per state layer); None for attention-only models."""
    return model.state_shapes() if hasattr(model, "state_shapes") else None


def kv_budget_bytes(config: EngineConfig, device: torch.device, state_bytes: int) -> int:
    """The paged KV's bytes: as configured, else a share of free memory, which the hybrids' states (not yet
    allocated, `state_bytes`) also draw from."""
    if config.cache.kv_cache_memory_bytes is not None:
        return config.cache.kv_cache_memory_bytes
    return int(device_mod.free_memory_bytes(device) * config.cache.kv_cache_memory_fraction) - state_bytes


def num_kv_blocks(budget_bytes: int, bytes_per_block: int, block_size: int, max_model_len: int,
                  max_num_seqs: int) -> int:
    """Blocks that fit the budget, at most enough for max_num_seqs sequences of max_model_len tokens. A count
    the budget limits is rounded down to a multiple of a power of two near 1/64 of it (at most 1/64 less): the
    block count is part of every compiled graph's cache key, and free memory differs a little from start to
    start, which would otherwise make a warm restart recompile everything."""
    blocks_per_seq = -(-max_model_len // block_size)
    fitting = budget_bytes // bytes_per_block
    if fitting < blocks_per_seq and fitting < 2:
        raise ValueError(f"the KV memory budget ({budget_bytes} bytes) holds no KV block of {bytes_per_block} bytes")
    cap = max_num_seqs * blocks_per_seq
    if fitting >= cap:
        return int(cap)
    granule = 1 << max((fitting // 64).bit_length() - 1, 0)
    return int(fitting // granule * granule)
