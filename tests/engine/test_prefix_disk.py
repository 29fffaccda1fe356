"""The prefix cache's disk tier on tiny random checkpoints (CPU, fp32): a prefix evicted from memory, or left by an
earlier engine on the same model, is read back and gives the same greedy tokens and logprobs as a fresh prefill;
corrupt, truncated and foreign files are skipped with one warning; another model never reads the files; the byte
budget holds."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from server.engine.model_runner import KVCache
from server.engine.prefix_disk import KV, STATE
from server.engine.types import SamplingParams
from tests.helpers import make_engine, random_ids

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)


def per_block_bytes(engine) -> int:
    return KVCache.bytes_per_block(engine.model.kv_cache_shapes(), 4, torch.float32)


def assert_same(out, ref) -> None:
    """Greedy tokens equal; each step's chosen and top-5 logprobs (the logits' head) equal within fp32 noise."""
    assert out.token_ids == ref.token_ids
    for a, b in zip(out.logprobs, ref.logprobs, strict=True):
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
        pairs = zip([a.logprob, *(t.logprob for t in a.top)], [b.logprob, *(t.logprob for t in b.top)], strict=True)
        assert max(abs(x - y) for x, y in pairs) < 1e-5


def disk_hits(engine) -> int:
    return engine.stats().prefix_cache_disk_hit_tokens


def files(engine, kind: str) -> list:
    return sorted(engine.kv_manager.disk.index.root.glob(f"*/{kind}-*.safetensors"))


@pytest.fixture
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


def test_evicted_prefix_reads_back_from_disk_as_a_fresh_prefill(llama, tmp_path):
    cold = make_engine(llama, enable_prefix_caching=False)
    # KV memory for one 80-token conversation: the second evicts the first, whose blocks go to disk.
    engine = make_engine(llama, prefix_cache_dir=str(tmp_path), kv_cache_memory_bytes=24 * per_block_bytes(cold))
    first, other = random_ids(61, seed=1), random_ids(80, seed=2)
    turn = engine.generate(first, PARAMS)
    engine.generate(other, PARAMS)
    engine.kv_manager.disk.io.drain()
    assert len(files(engine, KV)) >= 10
    follow_up = first + turn.token_ids + random_ids(9, seed=3)
    out = engine.generate(follow_up, PARAMS)
    assert disk_hits(engine) >= 40 and out.cached_tokens >= disk_hits(engine)
    assert_same(out, cold.generate(follow_up, PARAMS))
    stats = engine.stats()  # every prompt token counted once: from memory, from disk, or computed
    assert stats.prefix_cache_hit_tokens + stats.prefix_cache_miss_tokens == stats.prompt_tokens


def test_restart_serves_the_prefix_from_disk(llama, tmp_path):
    cold = make_engine(llama, enable_prefix_caching=False)
    prompt = random_ids(70, seed=4)
    first = make_engine(llama, prefix_cache_dir=str(tmp_path))
    first.generate(prompt, PARAMS)
    first.save_prefix_cache()  # what a server does at shutdown
    second = make_engine(llama, prefix_cache_dir=str(tmp_path))
    follow_up = prompt + random_ids(5, seed=5)
    out = second.generate(follow_up, PARAMS)
    assert out.cached_tokens == disk_hits(second) == 68  # 17 full blocks of the 70-token prompt
    assert_same(out, cold.generate(follow_up, PARAMS))
    # the blocks read back hold, bit for bit, the KV the first engine's prefill wrote
    keys = _prompt_hashes(first, prompt)[:17]
    for ours, theirs in zip(second.kv_cache.layers, first.kv_cache.layers, strict=True):
        read_back = ours[[second.kv_manager.allocator.cached[k] for k in keys]]
        assert torch.equal(read_back, theirs[[first.kv_manager.allocator.cached[k] for k in keys]])


@pytest.mark.parametrize("arch", ["qwen3_5_text", "lfm2_moe"])
def test_hybrid_state_snapshot_survives_eviction_and_restart(arch, hybrid_checkpoint, tmp_path):
    path, _ = hybrid_checkpoint(arch)
    cold = make_engine(path, enable_prefix_caching=False)
    # One snapshot slot per sequence: with max_num_seqs=1 the next conversation evicts this one's snapshot.
    engine = make_engine(path, prefix_cache_dir=str(tmp_path), max_num_seqs=1,
                         kv_cache_memory_bytes=30 * per_block_bytes(cold))
    prompt = random_ids(50, seed=6)
    turn = engine.generate(prompt, PARAMS)
    engine.generate(random_ids(60, seed=7), PARAMS)
    engine.kv_manager.disk.io.drain()
    assert files(engine, STATE)
    follow_up = prompt + turn.token_ids + random_ids(7, seed=8)
    out = engine.generate(follow_up, PARAMS)
    assert disk_hits(engine) > 0 and out.cached_tokens >= 48
    ref = cold.generate(follow_up, PARAMS)
    assert_same(out, ref)
    engine.save_prefix_cache()
    restarted = make_engine(path, prefix_cache_dir=str(tmp_path))
    again = restarted.generate(follow_up, PARAMS)
    assert again.cached_tokens == disk_hits(restarted) >= 48
    assert_same(again, ref)


def test_corrupt_truncated_and_foreign_files_are_skipped_with_one_warning(llama, tiny_checkpoint, tmp_path, caplog):
    cold = make_engine(llama, enable_prefix_caching=False)
    prompt = random_ids(70, seed=9)
    writer = make_engine(llama, prefix_cache_dir=str(tmp_path))
    writer.generate(prompt, PARAMS)
    writer.save_prefix_cache()
    kv_files = {p.name: p for p in files(writer, KV)}
    chain = [writer.kv_manager.disk.index.path(KV, h).name for h in _prompt_hashes(writer, prompt)]
    # block 10's bytes flipped (same size: only the checksum sees it), block 12 truncated
    corrupt, truncated = kv_files[chain[10]], kv_files[chain[12]]
    data = bytearray(corrupt.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    reader = make_engine(llama, prefix_cache_dir=str(tmp_path))
    follow_up = prompt + random_ids(5, seed=10)
    with caplog.at_level(logging.WARNING, logger="server.engine.prefix_store"):
        out = reader.generate(follow_up, PARAMS)
        assert out.cached_tokens == disk_hits(reader) == 40  # the blocks before the corrupt one
        assert_same(out, cold.generate(follow_up, PARAMS))
        reader.generate(follow_up, PARAMS)  # the corrupt file is gone: no second warning
    warnings = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(warnings) == 2  # one per bad file (they are read in parallel)
    assert any(chain[10] in w and "checksum" in w for w in warnings)
    assert any(chain[12] in w and "unreadable" in w for w in warnings)
    assert not corrupt.exists()

    # Another model's file under this model's key: its fingerprint does not match, it is never served.
    qwen = tiny_checkpoint("qwen3")[0]
    other = make_engine(qwen, prefix_cache_dir=str(tmp_path))
    assert other.kv_manager.disk.index.root != reader.kv_manager.disk.index.root
    other.generate(prompt, PARAMS)
    other.save_prefix_cache()
    fresh = make_engine(llama, prefix_cache_dir=str(tmp_path))
    fresh.kv_manager.save_to_disk()
    own = fresh.kv_manager.disk.index.path(KV, _prompt_hashes(fresh, prompt)[0])
    foreign = other.kv_manager.disk.index.path(KV, _prompt_hashes(other, prompt)[0])
    shutil.copy(foreign, own)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="server.engine.prefix_store"):
        out = make_engine(llama, prefix_cache_dir=str(tmp_path)).generate(follow_up, PARAMS)
    assert out.cached_tokens == 0
    assert any("another model" in r.getMessage() for r in caplog.records)
    assert_same(out, cold.generate(follow_up, PARAMS))


def _prompt_hashes(engine, prompt: list[int]) -> list[bytes]:
    from server.engine.block_allocator import chain_hash

    hashes, parent = [], None
    for i in range(len(prompt) // 4):
        parent = chain_hash(parent, prompt[4 * i : 4 * i + 4])
        hashes.append(parent)
    return hashes


def test_a_different_dtype_or_block_size_never_reads_the_files(llama, tmp_path):
    base = make_engine(llama, prefix_cache_dir=str(tmp_path))
    roots = {base.kv_manager.disk.index.root}
    for change in (dict(dtype="bfloat16"), dict(block_size=8)):
        roots.add(make_engine(llama, prefix_cache_dir=str(tmp_path), **change).kv_manager.disk.index.root)
    assert len(roots) == 3
    assert make_engine(llama, prefix_cache_dir=str(tmp_path)).kv_manager.disk.index.root == base.kv_manager.disk.index.root


def test_byte_budget_evicts_least_recently_used_files(llama, tmp_path):
    probe = make_engine(llama, prefix_cache_dir=str(tmp_path / "probe"))
    probe.generate(random_ids(9, seed=11), PARAMS)
    probe.save_prefix_cache()
    file_size = files(probe, KV)[0].stat().st_size
    budget_files = 12
    engine = make_engine(llama, prefix_cache_dir=str(tmp_path / "tier"),
                         prefix_cache_disk_gb=budget_files * file_size / (1 << 30))
    prompt = random_ids(80, seed=12)
    engine.generate(prompt, PARAMS)
    engine.save_prefix_cache()
    index = engine.kv_manager.disk.index
    assert len(files(engine, KV)) == budget_files and index.total_bytes <= budget_files * file_size
    restarted = make_engine(llama, prefix_cache_dir=str(tmp_path / "tier"),
                            prefix_cache_disk_gb=budget_files * file_size / (1 << 30))
    assert len(restarted.kv_manager.disk.index) == budget_files  # what the budget kept is what a restart finds


def test_warm_prompts_fill_the_cache_and_bad_lines_name_their_line(tmp_path):
    from server.engine.engine import Engine
    from server.engine.warm import read_warm_prompts, warm_prefix_cache

    engine = Engine.from_pretrained("demo", device="cpu", prefix_cache_dir=str(tmp_path / "cache"))
    messages = [{"role": "system", "content": "You review code. " * 20}, {"role": "user", "content": "hello"}]
    warm = tmp_path / "warm.jsonl"
    warm.write_text(json.dumps({"messages": messages}) + "\n# a comment\n\n"
                    + json.dumps({"prompt": "plain text " * 30}) + "\n")
    assert warm_prefix_cache(engine, warm) > 100
    out = engine.chat(messages, SamplingParams(max_tokens=2, temperature=0.0))
    assert out.cached_tokens == (out.prompt_tokens - 1) // 16 * 16 > 0
    warm.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"messages": "not a list"}) + "\n")
    with pytest.raises(ValueError, match=r"warm.jsonl:2: expected"):
        read_warm_prompts(warm, engine.inputs)


def test_steps_that_evict_to_and_load_from_disk_never_sync_with_the_host(llama, tmp_path):
    from tests.kernels.sync_guard import assert_no_host_sync

    probe = make_engine(llama, enable_prefix_caching=False)
    engine = make_engine(llama, prefix_cache_dir=str(tmp_path), kv_cache_memory_bytes=24 * per_block_bytes(probe))
    first = random_ids(61, seed=13)
    with assert_no_host_sync():  # the engine thread's steps: evicted blocks copied out, disk blocks copied in
        engine.generate(first, PARAMS)
        engine.generate(random_ids(80, seed=14), PARAMS)
        engine.kv_manager.disk.io.drain()
        out = engine.generate(first + [1, 2, 3], PARAMS)
    assert disk_hits(engine) > 0 and out.cached_tokens > 0


def test_hybrid_next_turn_that_re_renders_the_reply_reuses_the_prompt_end_state(hybrid_checkpoint, tmp_path):
    """Templates drop past reasoning, so the next prompt extends this prompt but not the reply: the state snapshot
    at the prompt's last full block is kept (decode does not roll it away), in memory and through the disk."""
    path, _ = hybrid_checkpoint("qwen3_5_text")
    cold = make_engine(path, enable_prefix_caching=False)
    engine = make_engine(path, prefix_cache_dir=str(tmp_path), max_num_seqs=1)
    prompt = random_ids(40, seed=15)  # 10 full blocks of 4: the state kept is the one at 36, before the last token
    engine.generate(prompt, PARAMS)  # 8 decode tokens: snapshots at 40, 44 and 48 too
    next_prompt = prompt + random_ids(6, seed=16)  # a reply rendered differently, then the user's message
    out = engine.generate(next_prompt, PARAMS)
    assert out.cached_tokens == 36
    assert_same(out, cold.generate(next_prompt, PARAMS))
    engine.save_prefix_cache()
    restarted = make_engine(path, prefix_cache_dir=str(tmp_path))
    again = restarted.generate(prompt + random_ids(9, seed=17), PARAMS)
    assert again.cached_tokens == disk_hits(restarted) == 36


def test_a_failing_write_is_logged_and_retried_later_never_hangs(llama, tmp_path, monkeypatch, caplog):
    from server.engine import prefix_store

    engine = make_engine(llama, prefix_cache_dir=str(tmp_path))
    engine.generate(random_ids(30, seed=18), PARAMS)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger="server.engine.prefix_store"):
        patch.setattr(prefix_store, "save_file", full_disk)
        assert engine.save_prefix_cache(wait=False) is True  # queued; the writer fails each file
        engine.kv_manager.disk.io.drain()
    assert not files(engine, KV) and any("No space left" in r.getMessage() for r in caplog.records)
    engine.save_prefix_cache()  # the space came back: the same blocks are written now
    assert len(files(engine, KV)) == len(engine.kv_manager.allocator.cached) == 9  # 37 tokens computed
