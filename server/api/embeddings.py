"""POST /v1/embeddings (OpenAI wire format) for embedding checkpoints: input as a string, a list of strings, token
ids or a list of token-id lists; encoding_format float or base64 (little-endian float32, as openai-python
decodes it); `dimensions` truncates (and renormalizes when the model normalizes). Other models answer 400.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from server.api.errors import APIError, from_engine_error
from server.api.routes import parse_body, read_json
from server.api.schemas import StrictInt
from server.api.state import ServingState

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request

router = APIRouter()


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: Any  # checked by prompts(), so that any wrong shape is one error naming `input`
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: str | None = None

    def prompts(self) -> list[str | list[int]]:
        inputs = self.input
        if isinstance(inputs, str):
            return [inputs]
        if not isinstance(inputs, list) or not inputs:
            raise APIError(400, f"input must be a string or a non-empty list; {_SHAPES}", param="input")
        if all(_is_id(item) for item in inputs):
            return [list(inputs)]
        if len(inputs) > MAX_INPUTS:
            raise APIError(400, f"input holds {len(inputs)} items; at most {MAX_INPUTS} are accepted.", param="input")
        for item in inputs:
            if not (isinstance(item, str) or (isinstance(item, list) and all(_is_id(t) for t in item))):
                raise APIError(400, f"input holds {type(item).__name__} {str(item)[:40]!r}; {_SHAPES}", param="input")
        return list(inputs)


_SHAPES = "send a string, a list of strings, a list of token ids or a list of token-id lists."


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> dict[str, Any]:
    state: ServingState = request.app.state.serving
    req: EmbeddingRequest = parse_body(EmbeddingRequest, await read_json(request, state.config.max_request_body_bytes))
    engine = await state.engine_for(req.model)
    try:
        vectors, num_tokens = await engine.embed(req.prompts(), req.dimensions)
    except Exception as exc:
        err = from_engine_error(exc, about_input=True)
        if err.param == "prompt":
            err.param = "input"
        raise err from None
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": state.served_model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
