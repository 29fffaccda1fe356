"""One rank of the 2-process Gloo tests (tests/engine/test_distributed.py), started as
`python -m tests.engine.dist_worker SPEC.json` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as
torchrun sets them. Rank 0 builds each model of the spec split over the ranks and runs it through the public
API; the other rank follows (server.engine.distributed.follow), as under `torchrun -m server ...`.

SPEC: {"kind": "tensor" | "pipeline", "models": [checkpoint dirs], "prompts": [[ids]], "num_new": N,
"out": file for rank 0's results (one per model, in order), "forever": bool (generate until killed, for the
lost-rank tests), "schema": a JSON schema (optional: the first prompt also constrained by it, beside the second)}.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import torch

from server.engine import distributed
from server.engine.types import SamplingParams, StructuredOutput
from tests.helpers import make_engine


def lead(spec: dict) -> None:
    sizes = {f"{spec['kind']}_parallel": 2}
    params = SamplingParams(max_tokens=spec["num_new"], temperature=0.0, ignore_eos=True)
    results = []
    for path in spec["models"]:
        engine = make_engine(path, **sizes)
        tokens = [out.token_ids for out in engine.generate(spec["prompts"], params)]
        results.append({"tokens": tokens, "logits": engine.score(spec["prompts"][0])})
        if spec.get("schema") is not None:  # a constrained row beside a free one: the bitmask reaches rank 0's sampler
            constrained = replace(params, structured=StructuredOutput.from_json_schema(spec["schema"]))
            outputs = engine.run_to_completion([engine.inputs.make_request(spec["prompts"][0], constrained),
                                                engine.inputs.make_request(spec["prompts"][1], params)])
            results[-1]["constrained"] = [out.token_ids for out in outputs]
        while spec.get("forever"):
            print("stepping", flush=True)
            engine.generate(spec["prompts"], params)
    torch.save(results, spec["out"])


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    env = os.environ
    info = distributed.ProcessInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["RANK"]))
    distributed.init(info, 2, "cpu")
    try:
        lead(spec) if info.rank == 0 else distributed.follow()
    except BaseException as exc:  # noqa: B036 - as the CLI: a failing rank ends the others
        distributed.abandon(exc)
    distributed.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
