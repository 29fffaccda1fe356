"""The `mps-serve` command: generate on the demo model and info, as a user runs them (subprocess); serve's engine
factory in process."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from server import cli
from server.bench.options import options_from_args
from server.kernels.capabilities import brief_reason, failure_reason


def run_cli(*args: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MPS_SERVE_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "server", *args], env=env, capture_output=True, text=True, timeout=180)


def test_generate_defaults_to_the_demo_with_no_network(tmp_path):
    done = run_cli("generate", "--prompt", "hi", "--max-tokens", "5", "--chat", "--device", "cpu", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "generated" in done.stderr and "finish_reason=" in done.stderr
    assert (tmp_path / "demo-v1" / "model.safetensors").is_file()


def test_generate_errors_say_what_to_fix(tmp_path):
    done = run_cli("generate", str(tmp_path / "nope"), "--prompt", "hi", tmp_path=tmp_path)
    assert done.returncode == 2 and "mps-serve: error:" in done.stderr and "nope" in done.stderr
    done = run_cli("generate", "demo", "--prompt", "hi", "--max-tokens", "0", "--device", "cpu", tmp_path=tmp_path)
    assert done.returncode == 2 and "max_tokens must be at least 1" in done.stderr


def test_info_explains_the_device_choice(tmp_path):
    done = run_cli("info", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "MPS:" in done.stdout and "device:" in done.stdout and "fast paths:" in done.stdout
    assert "flex_decode" not in done.stdout  # compiling probes only on request
    # the MPS plans' ops against torch 2.15's MPS kernels (tests/kernels/test_mps_audit.py keeps the list whole)
    assert "none would run through the CPU fallback" in done.stdout


def test_info_compile_probes_say_whether_flex_decode_runs(tmp_path):
    done = run_cli("info", "--device", "cpu", "--compile-probes", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if "flex_decode" in line)
    assert line.split()[1] in ("yes", "no") and len(line.split()) > 3  # a verdict and its reason


def test_serve_freezes_what_start_up_left_for_the_gc(tmp_path, monkeypatch):
    """serve's engine factory warms up and then moves the start-up objects out of the cyclic GC's reach (a full
    collection walking the compiled graphs stalled every stream for 1.4-2.4 s on the H200). In process: the
    server itself is replaced by a call of the factory."""
    monkeypatch.setenv("MPS_SERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    frozen = {}

    def run_server(config, engine_factory):
        gc.unfreeze()
        engine = engine_factory()
        frozen["engine"] = gc.get_freeze_count()
        gc.unfreeze()
        asyncio.run(engine.shutdown())
        return 0

    monkeypatch.setattr("server.api.server.run_server", run_server)
    assert cli.main(["--log-level", "warning", "serve", "demo", "--device", "cpu"]) == 0
    assert frozen["engine"] > 10_000  # the model, tokenizer and engine objects, at least


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["serve", "generate", "bench", "info", "selfcheck", "quantize"])
def test_every_flag_says_what_it_does_and_its_default(command):
    parser = _subparsers(cli.build_parser())[command]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"{command} {name} has no help text"
        assert "default" in action.help or action.required, f"{command} {name}: help does not give the default"


@pytest.mark.parametrize("command", [["info"], ["generate", "--prompt", "hi"], ["serve"],
                                     ["bench", "--preset", "tiny-moe"], ["selfcheck"]])
def test_log_level_is_accepted_before_and_after_the_command(command):
    parser = cli.build_parser()
    assert parser.parse_args(command).log_level == "info"
    assert parser.parse_args(["--log-level", "warning", *command]).log_level == "warning"
    assert parser.parse_args([*command, "--log-level", "debug"]).log_level == "debug"
    assert parser.parse_args(["--log-level", "error", *command, "--log-level", "debug"]).log_level == "debug"


def test_compare_without_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # find_spec then answers "not installed"
    args = cli.build_parser().parse_args(["bench", "--preset", "tiny-moe", "--compare", "transformers"])
    with pytest.raises(ValueError, match=r"pip install 'mps-serve\[compare\]'"):
        options_from_args(args)
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert any(dep.startswith("transformers") for dep in pyproject["project"]["optional-dependencies"]["compare"])


def test_shutdown_grace_reaches_the_server_config(monkeypatch):
    seen = {}

    def run_server(config, engine_factory):
        seen["grace"] = config.server.shutdown_grace_s
        return 0

    monkeypatch.setattr("server.api.server.run_server", run_server)
    assert cli.main(["serve", "--shutdown-grace", "2.5"]) == 0
    assert seen["grace"] == 2.5
    assert cli.main(["serve"]) == 0 and seen["grace"] == 30.0
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--shutdown-grace", "-1"])


def test_probe_reasons_are_whole_sentences_and_wrap_without_cuts():
    long = "The op is missing here. " * 30 + "Backends: [CPU, CUDA]"
    reason = failure_reason(NotImplementedError(long + "\nsecond line"))
    assert reason.startswith("NotImplementedError: The op is missing here.") and reason.endswith("here.")
    assert "second line" not in reason and len(reason) < 360
    assert failure_reason(RuntimeError("short")) == "RuntimeError: short"
    line = "    fp8_grouped            no   " + reason
    wrapped = cli.readable(line).splitlines()
    assert len(wrapped) > 1 and all(len(row) <= 110 for row in wrapped)
    assert " ".join(wrapped).split() == line.split()  # every word kept, none cut


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_bad_port_is_a_one_line_argparse_error(port, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["serve", "--port", port])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--port" in error and "Traceback" not in error


def test_api_key_help_names_both_headers():
    help_text = _subparsers(cli.build_parser())["serve"].format_help()
    assert "x-api-key" in help_text


@pytest.mark.parametrize("exc, brief", [
    (NotImplementedError("Could not run 'aten::_scaled_grouped_mm_v2' with arguments from the 'CPU' backend. This "
                         "could be because the operator doesn't exist for this backend"), "_scaled_grouped_mm_v2: no CPU kernel"),
    (RuntimeError("Expected inputs of BF16 type but got mat_a.dtype=torch.float16"), "takes BF16 inputs only"),
    (RuntimeError("cpu has no device streams; host copies are synchronous"), "cpu has no device streams"),
    (ValueError("x" * 200), "x" * 56 + " ..."),
    (RuntimeError(""), "RuntimeError"),
])
def test_a_failed_probe_has_a_brief_reason(exc, brief):
    assert brief_reason(exc) == brief


def test_info_says_no_with_a_brief_reason_and_the_exception_under_verbose(tmp_path):
    brief = run_cli("info", "--device", "cpu", tmp_path=tmp_path)
    verbose = run_cli("info", "--device", "cpu", "--verbose", tmp_path=tmp_path)
    assert brief.returncode == verbose.returncode == 0, brief.stderr + verbose.stderr

    def refusals(out: str) -> dict[str, str]:
        rows = [line.split(None, 2) for line in out.splitlines() if line.startswith("    ") and len(line.split()) > 2]
        return {row[0]: row[2] for row in rows if row[1] == "no"}

    brief_no, verbose_no = refusals(brief.stdout), refusals(verbose.stdout)
    assert brief_no.keys() == verbose_no.keys() and "streams" in brief_no  # the CPU has no device streams
    for name, reason in brief_no.items():
        assert "Error" not in reason and len(reason) <= 60, (name, reason)
        assert verbose_no[name].split(":")[0].endswith("Error"), verbose_no[name]  # the exception, by its type


def test_serve_with_several_models_builds_a_registry(tmp_path, monkeypatch):
    """Repeated MODEL arguments and [[models]] entries become one registry: names, aliases, per-model settings,
    the budget and keep-alive flags; nothing loads before a request names a model."""
    monkeypatch.setenv("MPS_SERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    toml = tmp_path / "models.toml"
    kv = 1 << 20
    toml.write_text(f'[engine.cache]\nkv_cache_memory_bytes = {kv}\n\n[[models]]\nmodel = "demo"\n'
                    'name = "demo-int8"\naliases = ["small", "tiny"]\nquantization = "int8"\n'
                    'max_model_len = 64\n')
    seen = {}

    def run_server(config, engine_factory, models):
        seen.update(factory=engine_factory, models=models)
        return 0

    monkeypatch.setattr("server.api.server.run_server", run_server)
    assert cli.main(["serve", "demo", str(tmp_path / "missing"), "--device", "cpu"]) == 2  # no config.json
    assert cli.main(["serve", "demo", str(toml), "--served-model-name", "x"]) == 2
    assert cli.main(["serve", "demo", "demo", "--device", "cpu"]) == 2  # one name, two models
    args = ["serve", "demo", "--device", "cpu", "--config", str(toml), "--keep-alive", "60", "--models-memory-gb", "1.5"]
    assert cli.main(args) == 0
    registry = seen["models"]
    assert seen["factory"] is None
    assert registry.names() == ["demo", "demo-int8", "small", "tiny"]
    assert registry.budget_bytes == int(1.5 * 2**30)
    assert [slot.keep_alive_s for slot in registry.slots] == [60.0, 60.0]
    plain, int8 = registry.slots
    assert int8.spec.size_bytes - kv < (plain.spec.size_bytes - kv) / 2  # int8 weights against fp32 on the CPU
    assert all(slot.engine is None for slot in registry.slots)
    engine = int8.spec.build()
    try:
        assert engine.max_model_len == 64
    finally:
        asyncio.run(engine.shutdown())


def test_ollama_keep_alive_durations():
    from server.api.errors import APIError
    from server.api.ollama_schemas import keep_alive_seconds

    assert [keep_alive_seconds(v) for v in (None, 0, -1, "0", "-1", 30, "10s", "5m", "1h30m", "250ms")] == [
        None, 0.0, -1.0, 0.0, -1.0, 30.0, 10.0, 300.0, 5400.0, 0.25]
    with pytest.raises(APIError):
        keep_alive_seconds("5 minutes")
