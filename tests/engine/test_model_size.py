"""`mps-serve info MODEL`: the resident weight size in each precision from config.json alone equals what the engine
holds once the model is loaded that way; a Hub id reads only config.json, from the cache when offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server import cli
from server.engine.model_size import FORMS, human_bytes, model_sizes
from server.engine.weights import read_config
from tests.helpers import make_engine


@pytest.mark.parametrize("model_type", ["qwen3_moe", "llama"])
def test_each_form_is_what_the_loaded_engine_holds(tiny_checkpoint, model_type, capsys):
    path, _ = tiny_checkpoint(model_type)
    sizes = model_sizes(read_config(path))
    for form, quantization in FORMS.items():
        engine = make_engine(path, dtype="bfloat16", quantization=quantization)
        assert sizes.forms[form].weight_bytes == engine.weight_bytes, form
        assert sizes.forms[form].bits_per_weight == pytest.approx(engine.bits_per_weight), form
    assert sizes.forms["int4"].weight_bytes < sizes.forms["int8"].weight_bytes < sizes.forms["bf16"].weight_bytes
    assert cli.main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    for form, size in sizes.forms.items():
        line = next(line for line in out.splitlines() if line.split()[:1] == [form])
        assert human_bytes(size.weight_bytes) in line and f"{size.bits_per_weight:.2f} bits/weight" in line


def test_an_mlx_checkpoint_as_stored_is_what_loading_it_holds(tiny_checkpoint, tmp_path, capsys):
    path, _ = tiny_checkpoint("qwen3_moe")
    out_dir = tmp_path / "q4"
    assert cli.main(["quantize", str(path), str(out_dir), "--bits", "4", "--group-size", "32",
                     "--dtype", "bfloat16"]) == 0
    capsys.readouterr()
    assert cli.main(["info", str(out_dir)]) == 0
    stored = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  as stored"))
    engine = make_engine(out_dir, dtype="bfloat16")
    assert human_bytes(engine.weight_bytes) in stored and f"{engine.bits_per_weight:.2f} bits/weight" in stored
    assert "MLX 4-bit, groups of 32" in stored


def run_info(model: str, hf_home) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(hf_home))
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "server", "info", model], env=env, capture_output=True, text=True,
                          timeout=180)


def test_a_hub_id_reads_config_json_from_the_cache_offline(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("llama")
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--someone--tiny-llama"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit / "config.json").write_text((path / "config.json").read_text())
    done = run_info("someone/tiny-llama", tmp_path)
    assert done.returncode == 0, done.stderr
    sizes = model_sizes(json.loads((path / "config.json").read_text()))
    assert f"{human_bytes(sizes.forms['int4'].weight_bytes)}" in done.stdout


def test_an_offline_miss_is_one_line(tmp_path):
    done = run_info("someone/not-cached", tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "not in the Hugging Face cache" in done.stderr, done.stderr
