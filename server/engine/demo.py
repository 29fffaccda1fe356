"""The embedded `demo` model: a tiny random-weight qwen3_moe checkpoint with a real byte-level BPE tokenizer
and Qwen3's chat template, written to the user cache on first use so a fresh machine serves requests with no
download. Its text is gibberish; it exists to exercise the whole stack (loading, MoE, chat, streaming UTF-8).

Everything is built here, deterministically: the tokenizer is trained with `tokenizers` on the text below,
the weights come from a seeded torch.Generator. transformers is not needed (it is only the test reference).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

DEMO_DIR_NAME = "demo-v1"  # bump when the files below change, so old caches are not reused
CACHE_ENV = "MPS_SERVE_CACHE"
SEED = 1234
BPE_VOCAB_SIZE = 1000  # the 256-byte alphabet included
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
# Qwen2/Qwen3's pre-tokenizer split, so the demo tokenizes like the real family.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# (content, special): special ones are dropped by skip_special_tokens; the think/tool tags are not, as in Qwen3.
ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

TRAINING_TEXT = """\
The small model wakes up on a fresh machine and writes its own weights before it answers anyone.
It has two layers, eight experts and a router that picks two of them for every token it reads.
Nobody should expect wisdom from it: the numbers were drawn at random, so the words come out scrambled.
Still, the server around it is real. Requests arrive over HTTP, wait in a queue, and share the device.
A scheduler counts tokens, not phases, and a long prompt is cut into chunks so short replies keep flowing.
The cache keeps keys and values in blocks; when two requests share a system prompt, they share its blocks.
When a client hangs up, the engine frees the blocks at once and moves on to the next request in line.
Streaming text must never split a character in half, and a stop string must never leak to the client.
Tools are described in JSON; the assistant calls them with a name and arguments, and reads the results.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, 2 * i))

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
She said: "Don't worry, it's fine." They'll see; we've tried, and I'm sure you're right.
Numbers like 3.14159, 2024-07-26, 42, 1000 and 65536 appear in logs, prices and dates.
Le café de la gare sert un thé très chaud; à côté, l'élève lit un poème près de la fenêtre.
Déjà vu: où est la crème brûlée? Voilà, c'est l'été, et la mère de Noël prépare le dîner.
中文也可以出现在这里：我们今天学习语言模型，明天继续测试服务器。你好，世界！
模型很小，但是分词器是真的。数据在缓存里，请求在队列里。
Emoji show up too 🙂 🚀 🎉 and so do arrows → and symbols like ±, ×, ÷, € and £.
Once upon a time, a lighthouse keeper counted the ships that passed and wrote each name in a book.
In the morning the fog rolled in from the sea, and in the evening it rolled back out again.
The keeper had a cat, a kettle, and a radio that only played songs about the weather.
Every winter the storms grew louder, and every spring the gulls returned to the rocks below.
Children from the village visited on Sundays to climb the stairs and look at the great lamp.
"How many steps are there?" they asked, and the keeper always answered with a different number.
The river bends twice before it reaches the mill, where the old wheel still turns in the current.
Farmers bring grain in carts, and the miller weighs every sack before he grinds it into flour.
Bread from that flour is sold in the market square, next to apples, cheese, honey and fresh eggs.
Good software is written twice: once to learn what the problem is, and once to solve it well.
Tests compare real numbers against a trusted reference, on fresh random inputs, every time.
Measure first, then optimize the part that is slow, and write down what you measured and why.
Memory bandwidth decides how fast a small batch can decode, because every weight is read once per step.
Quantized weights take fewer bytes, so a step that reads them finishes sooner on the same hardware.
"""

CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def ensure_demo_model(cache_dir: str | Path | None = None) -> Path:
    """The demo checkpoint's directory, written on first use. `cache_dir` is the cache root (default
    `$MPS_SERVE_CACHE`, else `$XDG_CACHE_HOME/mps-serve`, else `~/.cache/mps-serve`); the model lives in
    `<root>/demo-v1`. Writing goes to a temporary directory that is renamed into place when complete, so
    a crash or a concurrent writer never leaves a half-written model behind."""
    if cache_dir is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
        cache_dir = os.environ.get(CACHE_ENV) or Path(xdg) / "mps-serve"
    root = Path(cache_dir).expanduser()
    target = root / DEMO_DIR_NAME
    if is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_DIR_NAME}-", dir=root))
    try:
        write_demo_model(tmp)
        if is_complete(target):  # another writer finished meanwhile: its files may be read already, keep them
            return target
        if target.exists():  # incomplete leftovers of some other writer: move them aside first
            stale = Path(tempfile.mkdtemp(prefix=f".{DEMO_DIR_NAME}-stale-", dir=root))
            os.replace(target, stale / DEMO_DIR_NAME)
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(tmp, target)
    except OSError:
        if not is_complete(target):  # another process finished first is fine; anything else is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def write_demo_model(out_dir: Path) -> None:
    """Write every file of the demo checkpoint into `out_dir` (which must exist)."""
    tokenizer = build_tokenizer()
    tokenizer.save(str(out_dir / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    config = demo_config(vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), eos_token_id=eos_id)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {"eos_token_id": [eos_id, pad_id], "pad_token_id": pad_id})
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(tokenizer))
    save_file(random_weights(config), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def build_tokenizer() -> BackendTokenizer:
    """A byte-level BPE trained on TRAINING_TEXT, then the ChatML / think / tool-call tokens added."""
    tokenizer = BackendTokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    return tokenizer


def tokenizer_config(tokenizer: BackendTokenizer) -> dict:
    added = {
        str(tokenizer.token_to_id(content)): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, special in ADDED_TOKENS
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "split_special_tokens": False,
        # the generic class: transformers then uses tokenizer.json as written, like mps-serve does
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def demo_config(vocab_size: int, eos_token_id: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "hidden_act": "silu",
        "attention_bias": False,
    }


def random_weights(config: dict) -> dict[str, torch.Tensor]:
    """HF qwen3_moe tensor names, per-expert layout. Matrices ~ N(0, 0.05), the embedding N(0, 0.5) so
    logits are not flat, norms 1 + 0.1 N(0, 1). Drawn in a fixed order from one seeded generator."""
    gen = torch.Generator().manual_seed(SEED)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    head_dim, inter = config["head_dim"], config["moe_intermediate_size"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim

    def matrix(rows: int, cols: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=torch.float32) * std

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=gen, dtype=torch.float32)

    weights = {"model.embed_tokens.weight": matrix(vocab, hidden, std=0.5)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        weights[p + "self_attn.q_proj.weight"] = matrix(q_dim, hidden)  # [heads * head_dim, hidden]
        weights[p + "self_attn.k_proj.weight"] = matrix(kv_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = matrix(kv_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = matrix(hidden, q_dim)
        weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
        weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        weights[p + "mlp.gate.weight"] = matrix(config["num_experts"], hidden)  # [experts, hidden]
        for e in range(config["num_experts"]):
            weights[p + f"mlp.experts.{e}.gate_proj.weight"] = matrix(inter, hidden)
            weights[p + f"mlp.experts.{e}.up_proj.weight"] = matrix(inter, hidden)
            weights[p + f"mlp.experts.{e}.down_proj.weight"] = matrix(hidden, inter)
    weights["model.norm.weight"] = norm(hidden)
    weights["lm_head.weight"] = matrix(vocab, hidden)
    return weights


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
