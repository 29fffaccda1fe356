"""The tensor side of the prefix cache's disk tier (server.engine.prefix_disk keeps the books): one KV block of every
layer, or one hybrid state snapshot of every state layer, to and from one safetensors file.

Writes never make the engine loop wait: between two steps the evicted slots are gathered on the compute stream into
a fresh device tensor, so the next step may overwrite the slots at once (stream order), and that tensor travels to
pinned host memory on the copy stream (kernels.streams). A writer thread waits for the copy, then writes the file
(temporary name, then rename). The bytes queued are bounded: past the bound a write is dropped, not waited for.
Reads check the format, the model fingerprint, the key, names, shapes, dtypes and a crc32 of every tensor; a file
that fails is skipped with one warning and never served.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from server.engine.device import serialized_device_work
from server.engine.prefix_disk import KV, STATE
from server.kernels import devices
from server.kernels.streams import DeviceStreams
from server.version import installed_version

log = logging.getLogger(__name__)

FORMAT = "mps-serve-prefix-1"
READ_THREADS = 4


def model_fingerprint(model: torch.nn.Module, dtype: torch.dtype, quantization: str | None, block_size: int,
                      state_specs: Any) -> str:
    """The identity of what the cached tensors depend on: engine version, architecture and arguments, dtype,
    quantization, block size, cache shapes, and every weight's name, shape, dtype and 64 values spread over it
    (so a fine-tune of the same shapes differs). One host read of the samples, at start-up."""
    digest = hashlib.blake2b(digest_size=16)
    header = {"format": FORMAT, "engine": installed_version(), "class": type(model).__name__,
              "args": repr(getattr(model, "args", None)), "dtype": str(dtype), "quantization": quantization,
              "block_size": block_size, "kv": repr(model.kv_cache_shapes()), "state": repr(state_specs)}
    digest.update(json.dumps(header, sort_keys=True).encode())
    samples = []
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        flat = tensor.detach().reshape(-1)
        samples.append(flat[:: max(1, flat.numel() // 64)][:64].contiguous().view(torch.uint8).reshape(-1))
    if samples:
        digest.update(torch.cat([s.to(samples[0].device) for s in samples]).cpu().numpy().tobytes())
    return digest.hexdigest()


def _crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.contiguous().view(torch.uint8).reshape(-1).numpy())


class PrefixStore:
    """`tensors[kind]`: the device tensors whose first dimension is the slot (KV: one per layer; state: every
    tensor of every state layer). Implements prefix_disk.PrefixIO."""

    def __init__(self, tensors: dict[str, list[torch.Tensor]], fingerprint: str, device: torch.device,
                 max_queued_bytes: int = 256 << 20):
        self.tensors, self.fingerprint, self.device = tensors, fingerprint, device
        self.max_queued_bytes = max_queued_bytes
        self.on_written: Callable[[str, bytes, int | None], None] = lambda kind, key, size: None
        self.streams = DeviceStreams(device)
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._space = threading.Lock()
        self._warned: set[Path] = set()
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="prefix-disk-read")
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk-write", daemon=True)
        self._writer.start()

    def slot_bytes(self, kind: str) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors[kind])

    # ---- writes -------------------------------------------------------------------------------
    def save(self, kind: str, items: Sequence[tuple[int, bytes, Path]]) -> list[bool]:
        size = self.slot_bytes(kind)
        taken = [self._reserve(size) for _ in items]
        accepted = [item for item, ok in zip(items, taken, strict=True) if ok]
        if accepted:
            self._queue_copies(kind, accepted, size)
        return taken

    def _reserve(self, size: int) -> bool:
        with self._space:
            if self._queued_bytes and self._queued_bytes + size > self.max_queued_bytes:
                return False  # the first write is always taken, so one larger than the bound still goes
            self._queued_bytes += size
            return True

    def _queue_copies(self, kind: str, items: list[tuple[int, bytes, Path]], size: int) -> None:
        index = torch.tensor([slot for slot, _, _ in items], dtype=torch.int64).to(self.device, non_blocking=True)
        # The gather is ordered before the next step on the compute stream; the copy to the host overlaps it.
        copies = [self.streams.copy_to_host(t.index_select(0, index)) for t in self.tensors[kind]]
        self._queue.put((kind, items, copies, size))

    def _write_loop(self) -> None:
        while True:
            kind, items, copies, size = self._queue.get()
            try:
                self._write_job(kind, items, copies, size)
            except Exception:  # the thread must live on: drain() waits for every job
                log.exception("prefix cache: a write failed")
            finally:
                self._queue.task_done()

    def _write_job(self, kind: str, items: list[tuple[int, bytes, Path]], copies: list, size: int) -> None:
        reported = 0
        try:
            with serialized_device_work(self.device):  # MPS: no device call beside the engine's
                host = [copy.wait() for copy in copies]
            for row, (_, key, path) in enumerate(items):
                self.on_written(kind, key, self._write(kind, key, path, [t[row] for t in host]))
                reported += 1
        finally:
            for _, key, _ in items[reported:]:  # not written: the tier may queue them again
                self.on_written(kind, key, None)
            with self._space:
                self._queued_bytes -= size * len(items)

    def _write(self, kind: str, key: bytes, path: Path, tensors: list[torch.Tensor]) -> int | None:
        metadata = {"format": FORMAT, "model": self.fingerprint, "kind": kind, "key": key.hex(),
                    "crc32": ",".join(str(_crc(t)) for t in tensors)}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({f"t{i}": t.contiguous() for i, t in enumerate(tensors)}, tmp, metadata)
            os.replace(tmp, path)
            return path.stat().st_size
        except Exception as exc:  # a full disk, a removed directory, a tensor safetensors refuses
            log.warning("prefix cache: could not write %s: %s", path, exc)
            tmp.unlink(missing_ok=True)
            return None

    def drain(self) -> None:
        self._queue.join()

    # ---- reads --------------------------------------------------------------------------------
    def read_many(self, kind: str, items: Sequence[tuple[bytes, Path]]) -> list[Any]:
        payloads = []
        for payload in self._readers.map(lambda item: self.read(kind, *item), items):
            if payload is None:
                break
            payloads.append(payload)
        return payloads

    def read(self, kind: str, key: bytes, path: Path) -> list[torch.Tensor] | None:
        try:
            tensors, problem = self._read_checked(kind, key, path)
        except FileNotFoundError:
            return None  # the budget removed it meanwhile: a plain miss
        except Exception as exc:  # safetensors raises its own errors on a truncated or garbled header
            tensors, problem = None, f"unreadable ({exc})"
        if problem is None:
            return tensors
        if path not in self._warned:
            self._warned.add(path)
            log.warning("prefix cache: skipping %s: %s", path, problem)
        return None

    def _read_checked(self, kind: str, key: bytes, path: Path) -> tuple[list[torch.Tensor] | None, str | None]:
        expected = self.tensors[kind]
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            own = {"format": FORMAT, "model": self.fingerprint, "kind": kind, "key": key.hex()}
            if any(meta.get(k) != v for k, v in own.items()):
                return None, "written for another model, build or key"
            if sorted(f.keys()) != sorted(f"t{i}" for i in range(len(expected))):
                return None, "unexpected tensors"
            tensors = [f.get_tensor(f"t{i}") for i in range(len(expected))]
        for t, ref in zip(tensors, expected, strict=True):
            if t.shape != ref.shape[1:] or t.dtype != ref.dtype:
                return None, "unexpected shapes or dtypes"
        if meta.get("crc32") != ",".join(str(_crc(t)) for t in tensors):
            return None, "checksum mismatch (corrupt)"
        return tensors, None

    def load(self, kind: str, items: Sequence[tuple[int, list[torch.Tensor]]]) -> None:
        index = torch.tensor([slot for slot, _ in items], dtype=torch.int64).to(self.device, non_blocking=True)
        pinned = devices.pins_host_memory(self.device)  # then each layer's copy runs while the next is gathered
        for i, t in enumerate(self.tensors[kind]):
            rows = torch.empty((len(items), *t.shape[1:]), dtype=t.dtype, pin_memory=pinned)
            torch.stack([payload[i] for _, payload in items], out=rows)
            t.index_copy_(0, index, rows.to(self.device, non_blocking=True))


def store_tensors(kv_layers: list[torch.Tensor], state_layers: list[tuple[torch.Tensor, ...]] | None
                  ) -> dict[str, list[torch.Tensor]]:
    """PrefixStore's tensors of an engine's KV cache and (hybrids) state cache."""
    return {KV: list(kv_layers), STATE: [t for layer in state_layers or [] for t in layer]}
