"""`--warm-prompts FILE`: prompts prefilled into the prefix cache at start-up, so the first request that shares one
(an agent's system prompt and tools) starts from cached KV.

The file is JSON Lines, one prompt per line: `{"messages": [...], "tools": [...]}` (rendered by the model's chat
template with the generation prompt, as a chat request would be; `tools` optional) or `{"prompt": "text"}`. Blank
lines and lines starting with `#` are skipped.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from server.engine.types import InvalidRequestError, SamplingParams

log = logging.getLogger(__name__)


def read_warm_prompts(path: str | Path, inputs) -> list[str]:
    """The prompts of a warm-prompts file, rendered (`inputs`: the engine's Inputs). ValueError naming the line
    of anything that is not one of the two forms."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if isinstance(entry, dict) and isinstance(entry.get("messages"), list):
            prompts.append(inputs.chat_prompt(entry["messages"], entry.get("tools")))
        elif isinstance(entry, dict) and isinstance(entry.get("prompt"), str):
            prompts.append(entry["prompt"])
        else:
            raise ValueError(f'{path}:{number}: expected {{"messages": [...]}} or {{"prompt": "..."}}')
    return prompts


def warm_prefix_cache(engine, path: str | Path) -> int:
    """Prefill every prompt of the file (one token generated each) on an idle engine. -> prompt tokens warmed;
    a prompt the engine refuses (too long) is skipped with a warning."""
    requests = []
    for prompt in read_warm_prompts(path, engine.inputs):
        try:
            requests.append(engine.inputs.make_request(prompt, SamplingParams(max_tokens=1, temperature=0.0)))
        except InvalidRequestError as exc:
            log.warning("warm prompt skipped: %s", exc)
    outputs = engine.run_to_completion(requests)
    total = sum(out.prompt_tokens for out in outputs)
    log.info("warmed the prefix cache with %d prompt(s), %d tokens (%d from cache)", len(outputs), total,
             sum(out.cached_tokens for out in outputs))
    return total
