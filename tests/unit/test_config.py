"""EngineConfig's sub-configs: the flat setting names mapped to their sections, the round trip through asdict (the
compile child's spec), and --config TOML files with flat [engine] keys, [engine.*] tables, or both."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from server.config import (
    ENGINE_SECTIONS,
    FLAT_KEYS,
    CacheConfig,
    CompileConfig,
    EngineConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    load_config,
)
from server.engine import scheduler

DEFAULT_TOML = Path(__file__).resolve().parents[2] / "server" / "configs" / "default.toml"


def test_every_flat_name_lands_in_its_section_under_the_same_name():
    assert FLAT_KEYS == {
        "model": "load", "revision": "load", "device": "load", "dtype": "load", "quantization": "load",
        "cpu_threads": "load",
        "block_size": "cache", "enable_prefix_caching": "cache", "kv_cache_memory_bytes": "cache",
        "kv_cache_memory_fraction": "cache", "prefix_cache_dir": "cache", "prefix_cache_disk_gb": "cache",
        "max_num_seqs": "scheduler", "max_num_batched_tokens": "scheduler", "max_model_len": "scheduler",
        "compile": "compilation", "cuda_graphs": "compilation", "compile_prefill": "compilation",
        "tensor_parallel": "parallel", "pipeline_parallel": "parallel", "distributed_timeout_s": "parallel",
    }
    config = EngineConfig.from_flat(model="m", revision="r", device="cpu", dtype="float32", quantization="fp8",
                                    cpu_threads=2, block_size=8, enable_prefix_caching=False,
                                    kv_cache_memory_bytes=1 << 20, kv_cache_memory_fraction=0.25, max_num_seqs=3,
                                    max_num_batched_tokens=64, max_model_len=256, compile="on", cuda_graphs=False,
                                    compile_prefill=True, pipeline_parallel=2, distributed_timeout_s=5.0)
    assert config == EngineConfig(
        load=LoadConfig("m", "r", "cpu", "float32", "fp8", 2),
        cache=CacheConfig(8, False, 1 << 20, 0.25),
        scheduler=SchedulerConfig(3, 64, 256),
        compilation=CompileConfig("on", False, True),
        parallel=ParallelConfig(1, 2, 5.0),
    )
    assert EngineConfig.from_flat(**config.flat()) == config
    assert config.replace_flat(compile="off", max_num_seqs=1) == dataclasses.replace(
        config, compilation=dataclasses.replace(config.compilation, compile="off"),
        scheduler=dataclasses.replace(config.scheduler, max_num_seqs=1))
    assert EngineConfig.from_flat() == EngineConfig()


def test_the_scheduler_takes_the_scheduler_section_itself():
    assert scheduler.SchedulerConfig is SchedulerConfig is ENGINE_SECTIONS["scheduler"]


def test_each_section_checks_its_own_values():
    assert EngineConfig.from_flat(quantization="none").load.quantization is None
    for bad, match in ((dict(compile="sometimes"), "compile="), (dict(quantization="int3"), "quantization"),
                       (dict(cpu_threads=0), "cpu_threads"), (dict(tensor_parallel=0), "at least 1"),
                       (dict(tensor_parallel=2, pipeline_parallel=2), "not both")):
        with pytest.raises(ValueError, match=match):
            EngineConfig.from_flat(**bad)


def test_unknown_and_flat_names_say_where_to_go():
    with pytest.raises(TypeError, match=r"unknown EngineConfig settings \['no_such'\]; valid: \[.*'block_size'"):
        EngineConfig.from_flat(max_num_seqs=2, no_such=1)
    with pytest.raises(TypeError, match=r"compile is compilation\.compile, max_num_seqs is scheduler\.max_num_seqs: "
                                        r"use EngineConfig\.from_flat"):
        EngineConfig(max_num_seqs=2, compile="on")
    with pytest.raises(TypeError, match="EngineConfig.cache must be a CacheConfig, got int"):
        EngineConfig(cache=16)


def test_asdict_round_trips_through_json_as_the_compile_child_spec_does():
    config = EngineConfig.from_flat(model="m", compile="on", kv_cache_memory_bytes=1 << 20, max_model_len=64)
    spec = json.loads(json.dumps(dataclasses.asdict(config)))
    assert set(spec) == set(ENGINE_SECTIONS) and spec["cache"]["kv_cache_memory_bytes"] == 1 << 20
    assert EngineConfig(**spec) == config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_the_shipped_default_toml_loads_as_the_defaults():
    assert load_config(DEFAULT_TOML).engine == EngineConfig()


def test_flat_and_sectioned_toml_give_the_same_config(tmp_path):
    flat = write(tmp_path, '[engine]\nmodel = "m"\nmax_num_seqs = 4\nblock_size = 32\ncompile = "off"\n'
                           '[server]\nport = 9000\n')
    loaded = load_config(flat)
    assert loaded.engine == EngineConfig.from_flat(model="m", max_num_seqs=4, block_size=32, compile="off")
    assert loaded.server.port == 9000
    sectioned = write(tmp_path, '[engine.load]\nmodel = "m"\n[engine.scheduler]\nmax_num_seqs = 4\n'
                                '[engine.cache]\nblock_size = 32\n[engine.compilation]\ncompile = "off"\n')
    assert load_config(sectioned).engine == loaded.engine
    mixed = write(tmp_path, '[engine]\nmodel = "m"\nmax_num_seqs = 4\n[engine.cache]\nblock_size = 32\n'
                            '[engine.compilation]\ncompile = "off"\n')
    assert load_config(mixed).engine == loaded.engine


def test_flags_override_either_form(tmp_path):
    path = write(tmp_path, '[engine.scheduler]\nmax_num_seqs = 4\nmax_model_len = 128\n')
    config = load_config(path, engine={"max_num_seqs": 2, "max_model_len": None, "device": "cpu"})
    assert config.engine.scheduler == SchedulerConfig(2, 512, 128)
    assert config.engine.load.device == "cpu"


@pytest.mark.parametrize(("text", "match"), [
    ('[engine.cache]\nmax_num_seqs = 4\n', r"unknown keys \['max_num_seqs'\] in \[engine\.cache\] "
                                           r"\(max_num_seqs belongs in \[engine\.scheduler\]\)"),
    ('[engine]\nport = 8080\n', r"unknown keys \['port'\] in \[engine\] \(port belongs in \[server\]\)"),
    ('[server]\nblock_size = 8\n', r"unknown keys \['block_size'\] in \[server\] \(block_size belongs in "
                                   r"\[engine\.cache\]\)"),
    ('[engine]\nno_such = 1\n', r"unknown keys \['no_such'\] in \[engine\]; valid keys are \[.*'\[engine\.cache\]'"),
    ('[engine.cache]\nno_such = 1\n', r"unknown keys \['no_such'\] in \[engine\.cache\]; valid keys are "
                                      r"\['block_size', 'enable_prefix_caching', 'kv_cache_memory_bytes', "
                                      r"'kv_cache_memory_fraction', 'prefix_cache_dir', 'prefix_cache_disk_gb'\]"),
    ('[cache]\nblock_size = 8\n', r"unknown sections \['cache'\] \(\[cache\] is \[engine\.cache\]\)"),
    ('[engine]\nblock_size = 8\n[engine.cache]\nblock_size = 16\n', r"\['block_size'\] given twice"),
    ('[engine]\ncache = 16\n', r"cache is a table \(\[engine\.cache\]\)"),
])
def test_a_misplaced_or_unknown_key_names_where_it_belongs(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_config(write(tmp_path, text))


def test_prefix_cache_disk_settings_from_toml_and_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[engine.cache]\nprefix_cache_dir = "/tmp/kv"\nprefix_cache_disk_gb = 2.5\n'
                    '[server]\nwarm_prompts = "warm.jsonl"\n')
    config = load_config(path, engine={"prefix_cache_disk_gb": 4.0})
    assert config.engine.cache.prefix_cache_dir == "/tmp/kv" and config.engine.cache.prefix_cache_disk_gb == 4.0
    assert config.server.warm_prompts == "warm.jsonl"
    with pytest.raises(ValueError, match="prefix_cache_disk_gb"):
        EngineConfig.from_flat(prefix_cache_disk_gb=0)


def test_models_tables_load_and_bad_entries_say_what_to_fix(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nmodel = "a"\naliases = ["x"]\nquantization = "int4"\n\n[[models]]\nmodel = "b"\n'
                    'max_model_len = 128\n')
    config = load_config(path)
    assert [(m.model, m.aliases, m.quantization, m.max_model_len) for m in config.models] == [
        ("a", ("x",), "int4", None), ("b", (), None, 128)]
    assert load_config().models == ()
    for text, match in (('[[models]]\nalias = "x"\n', "each with a `model` key"),
                        ('[[models]]\nmodel = "a"\nport = 1\n', r"unknown keys \['port'\] in \[\[models\]\]"),
                        ('models = "a"\n', "each with a `model` key")):
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            load_config(path)
