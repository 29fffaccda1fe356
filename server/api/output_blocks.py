"""Parsed output parts -> ordered blocks (reasoning, text, tool call), for the protocols whose output is a list of
blocks: Anthropic Messages (content blocks) and OpenAI Responses (output items).

A block opens when a part of another kind arrives and closes when the next block opens or the output ends, so the
streamed events and the final list come from one splitter and always agree.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Literal

from server.api.tool_parsers import Part, ToolCallArgs, ToolCallStart

BlockKind = Literal["reasoning", "text", "tool_call"]


@dataclass
class Block:
    index: int  # position in the output
    kind: BlockKind
    text: str = ""  # reasoning or text so far; for a tool call its JSON arguments so far
    call_id: str = ""
    name: str = ""

    def arguments(self) -> dict[str, Any]:
        """A tool call's arguments as an object; {} when generation stopped before they were valid JSON. A number
        past float's range (`61431e8446496323440`, valid JSON) becomes the largest finite float of its sign: JSON
        has no infinity, and the response must render."""
        try:
            value = json.loads(self.text, parse_float=_finite_float) if self.text.strip() else {}
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


def _finite_float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else math.copysign(sys.float_info.max, value)


@dataclass(frozen=True)
class BlockEvent:
    kind: Literal["open", "delta", "close"]
    block: Block
    text: str = ""  # the delta's text


class BlockSplitter:
    """feed(parts) / finish() -> BlockEvents; `blocks` holds every block seen, in order."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None

    @property
    def has_tool_calls(self) -> bool:
        return any(b.kind == "tool_call" for b in self.blocks)

    def feed(self, parts: list[Part]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for part in parts:
            if isinstance(part, ToolCallStart):
                self._start(Block(len(self.blocks), "tool_call", call_id=part.id, name=part.name), events)
            elif isinstance(part, ToolCallArgs):
                self._add(self._open, part.text, events)  # a call's arguments follow its start
            else:
                kind, text = part
                block_kind: BlockKind = "reasoning" if kind == "reasoning" else "text"
                if self._open is None or self._open.kind != block_kind:
                    self._start(Block(len(self.blocks), block_kind), events)
                self._add(self._open, text, events)
        return events

    def finish(self) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        self._close(events)
        return events

    def _start(self, block: Block, events: list[BlockEvent]) -> None:
        self._close(events)
        self.blocks.append(block)
        self._open = block
        events.append(BlockEvent("open", block))

    def _add(self, block: Block, text: str, events: list[BlockEvent]) -> None:
        if text:
            block.text += text
            events.append(BlockEvent("delta", block, text))

    def _close(self, events: list[BlockEvent]) -> None:
        if self._open is not None:
            events.append(BlockEvent("close", self._open))
            self._open = None
