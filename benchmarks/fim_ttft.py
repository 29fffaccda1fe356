"""Time to first token of fill-in-the-middle against a plain completion of the same length, over HTTP.

The demo model's tokenizer has no FIM tokens, so this serves a variant of it: the same architecture, sizes,
tokenizer and seeded random weights, with Qwen2.5-Coder's FIM and repository tokens added to the tokenizer (and
the vocabulary grown by as many rows). Through a real uvicorn on 127.0.0.1, streaming, prefix caching off and fresh
random text every time, alternating, `--reps` times each:
  fim     POST /v1/completions {prompt: prefix, suffix}    (prefix + suffix about --prompt-tokens tokens)
  plain   POST /v1/completions {prompt: prefix + suffix}   (the same text, no suffix: 3 tokens fewer)
  infill  POST /infill {input_prefix, input_suffix}
TTFT is from sending the request to the first streamed event that carries text or tokens. Target (issue 61): fim
no slower than plain.

    PYTHONPATH=. python3 benchmarks/fim_ttft.py [--prompt-tokens 2000] [--reps 5] [--device cpu] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from server.engine import demo

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
WORDS = demo.TRAINING_TEXT.split()


def write_fim_demo(out_dir: Path) -> None:
    """The demo checkpoint with FIM tokens in its tokenizer (added as Qwen2.5-Coder adds them: not special)."""
    from safetensors.torch import save_file
    from tokenizers import AddedToken

    tokenizer = demo.build_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in FIM_TOKENS])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    eos_id, pad_id = tokenizer.token_to_id(demo.EOS_TOKEN), tokenizer.token_to_id(demo.PAD_TOKEN)
    config = demo.demo_config(vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), eos_token_id=eos_id)
    (out_dir / "config.json").write_text(json.dumps(config))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id, pad_id]}))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(demo.tokenizer_config(tokenizer)))
    save_file(demo.random_weights(config), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


@contextmanager
def serving(model_dir: Path, device: str):
    import uvicorn

    from server.api.app import create_app
    from server.config import EngineConfig, ServerConfig
    from server.engine.async_engine import AsyncEngine

    config = EngineConfig.from_flat(model=str(model_dir), device=device, enable_prefix_caching=False)
    engine = AsyncEngine.from_config(config)
    app = create_app(engine, ServerConfig(served_model_name="fim-demo"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def random_code(rng: random.Random, num_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(num_words)]
    return "\n".join(" ".join(words[i:i + 8]) for i in range(0, num_words, 8)) + "\n"


def first_event_s(client, url: str, body: dict) -> tuple[float, dict]:
    """Seconds to the first event with text or tokens, and the last event (usage / totals)."""
    started, first, last = time.perf_counter(), None, {}
    with client.stream("POST", url, json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            has_text = event.get("content") or event.get("tokens") or any(c.get("text") for c in event.get("choices", []))
            if first is None and has_text:
                first = time.perf_counter() - started
            last = event
    return first, last


def words_per_side(model_dir: Path, num_tokens: int, rng: random.Random) -> int:
    """How many words of random_code make prefix + suffix about `num_tokens` tokens with this tokenizer."""
    from tokenizers import Tokenizer

    sample = random_code(rng, 800)
    tokens_per_word = len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(sample).ids) / 800
    return round(num_tokens / 2 / tokens_per_word)


def measure(base: str, words: int, args: argparse.Namespace) -> dict:
    import httpx

    rng = random.Random(args.seed)
    timings: dict[str, list[float]] = {"fim": [], "plain": [], "infill": []}
    prompt_tokens: dict[str, int] = {}
    common = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    with httpx.Client() as client:
        for rep in range(args.reps + 1):  # the first round warms up and is not counted
            prefix, suffix = random_code(rng, words), random_code(rng, words)
            runs = {
                "fim": (f"{base}/v1/completions", {**common, "prompt": prefix, "suffix": suffix}),
                "plain": (f"{base}/v1/completions", {**common, "prompt": prefix + suffix}),
                "infill": (f"{base}/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 4,
                                               "temperature": 0, "ignore_eos": True, "stream": True}),
            }
            for name in (list(runs) if rep % 2 == 0 else list(reversed(runs))):
                seconds, last = first_event_s(client, *runs[name])
                prompt_tokens[name] = last.get("usage", {}).get("prompt_tokens") or last.get("tokens_evaluated")
                if rep:
                    timings[name].append(seconds)
    return {"prompt_tokens": prompt_tokens, "reps": args.reps,
            "ttft_ms_median": {k: 1000 * statistics.median(v) for k, v in timings.items()},
            "ttft_ms_all": {k: [round(1000 * s, 1) for s in v] for k, v in timings.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_fim_demo(Path(tmp))
        words = words_per_side(Path(tmp), args.prompt_tokens, random.Random(args.seed))
        with serving(Path(tmp), args.device) as base:
            record = measure(base, words, args)
    medians = record["ttft_ms_median"]
    record["fim_over_plain"] = medians["fim"] / medians["plain"]
    for name, ms in medians.items():
        print(f"{name:7s} prompt {record['prompt_tokens'][name]:5d} tokens   TTFT median {ms:8.1f} ms   "
              f"all {record['ttft_ms_all'][name]}")
    print(f"fim / plain TTFT: {record['fim_over_plain']:.3f}")
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
