"""The Hugging Face cache behind Ollama's /api/pull and /api/delete, through huggingface_hub.

A model name is a Hub repo id, with an optional `:revision` in the place of Ollama's tag (`:latest` is the default
branch). Pull lists the repo's files first (a failure there is the request's error: offline, unknown repo, Hub
out of reach), then downloads them one by one, reporting each file's bytes as Ollama's progress events (`digest`
is the file's name). huggingface_hub's own offline switch (HF_HUB_OFFLINE=1) refuses every pull.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import constants, hf_hub_download, scan_cache_dir, snapshot_download
from huggingface_hub.errors import (
    CacheNotFound,
    GatedRepoError,
    HFValidationError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id
from tqdm.auto import tqdm

from server.api.errors import APIError


@dataclass
class PullPlan:
    name: str
    repo_id: str
    files: list[Any]  # huggingface_hub's DryRunFileInfo: filename, file_size, commit_hash, will_download


def repo_and_revision(name: str) -> tuple[str, str | None]:
    repo_id, _, tag = name.partition(":")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise APIError(400, f"invalid model name {name!r}: a Hugging Face repo id is expected "
                       f"(org/name, optionally :revision): {exc}") from None
    return repo_id, (tag if tag and tag != "latest" else None)


async def plan_pull(name: str) -> PullPlan:
    """What pulling `name` downloads; raises APIError when it cannot start."""
    repo_id, revision = repo_and_revision(name)
    if constants.is_offline_mode():
        raise APIError(503, f"cannot pull {name}: the server runs offline (HF_HUB_OFFLINE=1), so nothing is "
                       "downloaded; fetch the model elsewhere, or restart the server online.")
    try:
        files = await asyncio.to_thread(snapshot_download, repo_id, revision=revision, dry_run=True)
    except Exception as exc:
        raise _hub_error(name, exc) from None
    return PullPlan(name, repo_id, list(files))


def _hub_error(name: str, exc: Exception) -> APIError:
    if isinstance(exc, RevisionNotFoundError):
        return APIError(404, f"pull model manifest: revision of {name} not found on the Hugging Face Hub")
    if isinstance(exc, GatedRepoError):
        return APIError(403, f"pull model manifest: {name} is gated; accept its terms on the Hub and log in (HF_TOKEN)")
    if isinstance(exc, RepositoryNotFoundError):
        return APIError(404, f"pull model manifest: {name} not found on the Hugging Face Hub")
    if isinstance(exc, OfflineModeIsEnabled):
        return APIError(503, f"cannot pull {name}: huggingface_hub is in offline mode (HF_HUB_OFFLINE=1).")
    return APIError(502, f"cannot reach the Hugging Face Hub to pull {name}: {type(exc).__name__}: {exc}")


async def pull_events(plan: PullPlan, served_name: str) -> AsyncIterator[dict[str, Any]]:
    """Ollama's progress events while the files download; a failure is one `{"error": ...}` event, last."""
    yield {"status": "pulling manifest"}
    try:
        for info in plan.files:
            size = info.file_size or 0
            yield {"status": f"pulling {info.filename}", "digest": info.filename, "total": size,
                   "completed": 0 if info.will_download else size}
            if info.will_download:
                async for done in _download(plan, info):
                    yield {"status": f"pulling {info.filename}", "digest": info.filename, "total": size,
                           "completed": done}
    except Exception as exc:
        yield {"error": _hub_error(plan.name, exc).message}
        return
    yield {"status": f"{plan.repo_id} is in the Hugging Face cache; this server keeps serving {served_name}: "
                     f"start it with `mps-serve serve {plan.repo_id}` to serve the new model"}
    yield {"status": "success"}


async def _download(plan: PullPlan, info: Any) -> AsyncIterator[int]:
    """Download one file on a worker thread; yields the bytes done as they grow."""
    loop = asyncio.get_running_loop()
    progress: asyncio.Queue[int] = asyncio.Queue()

    def report(done: int) -> None:  # on the worker thread
        loop.call_soon_threadsafe(progress.put_nowait, done)

    task = loop.run_in_executor(None, lambda: hf_hub_download(
        plan.repo_id, info.filename, revision=info.commit_hash, tqdm_class=_progress_class(report)))
    while not task.done() or not progress.empty():
        getter = asyncio.ensure_future(progress.get())
        await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            yield getter.result()
        else:
            getter.cancel()
    task.result()  # re-raises a failed download
    yield info.file_size or 0


def _progress_class(report: Callable[[int], None]) -> type:
    """A silent tqdm whose updates go to `report` (huggingface_hub reports a download's bytes through tqdm)."""

    class Progress(tqdm):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **{**kwargs, "disable": True})
            self.bytes_done = 0

        def update(self, n: float | None = 1) -> None:
            self.bytes_done += int(n or 0)
            report(self.bytes_done)

    return Progress


async def delete(name: str, served: set[str]) -> None:
    """Delete every cached revision of repo `name`; 404 when the cache holds none, 400 for the served model."""
    repo_id, _ = repo_and_revision(name)
    if name in served or repo_id in served:
        raise APIError(400, f"{name} is the model this server serves; it cannot be deleted while served.")
    try:
        cache = await asyncio.to_thread(scan_cache_dir, constants.HF_HUB_CACHE)
    except CacheNotFound:
        raise APIError(404, f"model '{name}' not found") from None
    repo = next((r for r in cache.repos if r.repo_id == repo_id and r.repo_type == "model"), None)
    if repo is None:
        raise APIError(404, f"model '{name}' not found")
    if any(_inside(path, repo.repo_path) for path in served):
        raise APIError(400, f"{name} holds the checkpoint this server serves; it cannot be deleted while served.")
    strategy = cache.delete_revisions(*(revision.commit_hash for revision in repo.revisions))
    await asyncio.to_thread(strategy.execute)


def _inside(path: str, folder: Path) -> bool:
    try:
        return Path(path).resolve().is_relative_to(folder.resolve())
    except (OSError, ValueError):
        return False
