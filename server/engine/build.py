"""Wiring an engine: load a checkpoint, size the KV cache and the hybrid state pool, build the scheduler and
the model runner. Plain functions from values to values; `Engine.__init__` calls `build_parts`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from server.config import EngineConfig
from server.engine import device as device_mod
from server.engine.block_allocator import BlockAllocator
from server.engine.decode_graphs import DecodeGraphs, use_flex_at_batch_1
from server.engine.kv_manager import KVManager
from server.engine.model_runner import CompiledSteps, KVCache, ModelRunner
from server.engine.scheduler import Scheduler, SchedulerConfig
from server.engine.state_cache import StateCache, state_pool
from server.engine.tokenizer import Tokenizer
from server.engine.weights import load_model, read_config, resolve_model_path
from server.models.parallel import Layout

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    kv_cache: KVCache
    state_cache: StateCache | None  # hybrids only
    kv_manager: KVManager
    scheduler: Scheduler
    runner: ModelRunner
    compile_prefill: bool  # the config's None resolved for this device and model


def load_pretrained(config: EngineConfig, layout: Layout | None = None
                    ) -> tuple[torch.nn.Module, Tokenizer, torch.device, torch.dtype, int]:
    """-> (model, tokenizer, device, dtype, max_model_len) of `config.model` (the demo, a path or a Hub id);
    under a parallel `layout`, this rank's part of the model."""
    if config.model == "demo":
        from server.engine.demo import ensure_demo_model

        model_dir = ensure_demo_model()
    else:
        model_dir = resolve_model_path(config.model, config.revision)
    device, reason = device_mod.select_device(config.device)
    hf_config = read_config(model_dir)
    checkpoint_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
    dtype = device_mod.select_dtype(config.dtype, device, checkpoint_dtype)
    log.info("loading %s on %s (%s) as %s", config.model, device, reason, dtype)
    start = time.perf_counter()
    model, _ = load_model(model_dir, device, dtype, config.quantization, layout)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    log.info("weights loaded%s in %.1f s", " and quantized" if config.quantization else "", time.perf_counter() - start)
    limit = int(getattr(model.args, "max_position_embeddings", None) or 4096)  # nested text_config resolved
    return model, tokenizer, device, dtype, min(config.max_model_len or limit, limit)


def build_parts(model, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                max_model_len: int, agree_num_blocks: Callable[[int], int] | None = None) -> EngineParts:
    """`agree_num_blocks`: across the ranks of a parallel model, the block count all of them hold."""
    specs = model.state_shapes() if hasattr(model, "state_shapes") else None
    # The state pool is allocated first: the KV budget's share of free memory then accounts for it.
    state_cache, state_slots, state_bytes = state_pool(
        specs, config.max_num_seqs, config.enable_prefix_caching, config.block_size, dtype, device
    )
    shapes = model.kv_cache_shapes()
    budget = kv_budget_bytes(config, device, state_bytes)
    # at least 1: a pipeline stage without attention layers holds no KV, only the block count every rank shares
    per_block = max(KVCache.bytes_per_block(shapes, config.block_size, dtype), 1)
    num_blocks = num_kv_blocks(budget, per_block, config.block_size, max_model_len, config.max_num_seqs)
    if agree_num_blocks is not None:
        num_blocks = agree_num_blocks(num_blocks)
    # One more block than the budget's: block 0 is the scratch target of padded decode rows.
    kv_cache = KVCache(shapes, num_blocks + 1, config.block_size, dtype, device)
    allocator = BlockAllocator(num_blocks + 1, config.block_size, config.enable_prefix_caching, num_reserved=1)
    kv_manager = KVManager(allocator, state_slots)
    limits = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len)
    scheduler = Scheduler(limits, kv_manager)
    graphs = decode_graphs(model, config, device, dtype, kv_cache, state_cache, max_model_len)
    runner = ModelRunner(model, kv_cache, device, model.args.vocab_size, graphs, state_cache)
    compile_prefill = wants_compiled_prefill(config, device, graphs is not None, state_cache is not None)
    if compile_prefill:
        caches = list(kv_cache.layers) + [t for layer in (state_cache.layers if state_cache else []) for t in layer]
        runner.forward_steps = CompiledSteps(model, caches, size_oblivious=state_cache is None)
    return EngineParts(kv_cache, state_cache, kv_manager, scheduler, runner, compile_prefill)


def kv_budget_bytes(config: EngineConfig, device: torch.device, state_bytes: int) -> int:
    """The paged KV's bytes: as configured, else a share of free memory, which the hybrids' states (allocated
    already, `state_bytes`) also draw from."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    return int(device_mod.free_memory_bytes(device) * config.kv_cache_memory_fraction) - state_bytes


def num_kv_blocks(budget_bytes: int, bytes_per_block: int, block_size: int, max_model_len: int,
                  max_num_seqs: int) -> int:
    """Blocks that fit the budget, at most enough for max_num_seqs sequences of max_model_len tokens."""
    blocks_per_seq = -(-max_model_len // block_size)
    num_blocks = min(budget_bytes // bytes_per_block, max_num_seqs * blocks_per_seq)
    if num_blocks < blocks_per_seq and num_blocks < 2:
        raise ValueError(f"the KV memory budget ({budget_bytes} bytes) holds no KV block of {bytes_per_block} bytes")
    return int(num_blocks)


def decode_graphs(model, config: EngineConfig, device: torch.device, dtype: torch.dtype, kv_cache: KVCache,
                  state_cache: StateCache | None, max_model_len: int) -> DecodeGraphs | None:
    """The compiled decode step: on by default on GPU backends, off on the CPU (tests switch it on)."""
    if config.compile == "off" or (config.compile == "auto" and device.type == "cpu"):
        return None
    flex = use_flex_at_batch_1(device, dtype, config.block_size, state_cache is None)
    blocks_per_seq = -(-max_model_len // config.block_size)
    graphs = config.cuda_graphs if config.cuda_graphs is not None else True
    return DecodeGraphs(model, kv_cache.layers, device, config.max_num_seqs, blocks_per_seq, graphs,
                        state_cache=state_cache, flex_at_batch_1=flex)


def wants_compiled_prefill(config: EngineConfig, device: torch.device, decode_compiled: bool, hybrid: bool) -> bool:
    """An explicit setting wins. None: on where compiling makes prefill faster: with the compiled decode step, on
    CUDA, attention-only models (a hybrid's dynamic-shape prefill graph takes minutes to compile cold)."""
    if config.compile_prefill is not None:
        return config.compile_prefill
    return decode_compiled and device.type == "cuda" and not hybrid
