"""The serving side of the compile child reads its reports without hanging on a child that says less than
expected, fails a stage, or dies."""

from __future__ import annotations

import json
import os
import sys

from server.compile.child import CompileChild


def scripted_child(tmp_path, lines: list[dict | str], exit_code: int = 0, misses=lambda: 0) -> CompileChild:
    """A child that checks it got the spec, prints `lines` and ends with `exit_code`."""
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    script = (f"import json, sys; assert json.loads(sys.stdin.readline()) == {{'model': 'm'}}; "
              f"print({text!r}, flush=True); sys.exit({exit_code})")
    return CompileChild.start({"model": "m"}, [sys.executable, "-c", script], dict(os.environ), tmp_path / "log",
                              misses)


def test_reports_are_read_in_order_and_a_stage_the_child_skips_does_not_wait(tmp_path):
    child = scripted_child(tmp_path, [{"stages": ["one", "two", "four"]}, {"stage": "one", "ok": True, "seconds": 1},
                                      "not json", {"stage": "two", "ok": False, "error": "boom"},
                                      {"stage": "four", "ok": True, "seconds": 2}])
    assert child.wait_for("one") is True
    assert child.wait_for("two") is False  # failed in the child: the serving process compiles it
    assert child.wait_for("three") is False  # never announced
    assert child.wait_for("four") is True
    child.close()


def test_a_child_that_fails_or_dies_ends_every_wait(tmp_path):
    child = scripted_child(tmp_path, [{"failed": "no such model"}], exit_code=1)
    assert child.wait_for("one") is False and child.wait_for("two") is False
    child.close()
    child = scripted_child(tmp_path, [{"stages": ["one", "two"]}, {"stage": "one", "ok": True, "seconds": 1}], 3)
    assert child.wait_for("one") is True and child.wait_for("two") is False
    child.close()


def test_close_ends_a_child_still_compiling(tmp_path):
    child = CompileChild.start({}, [sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ),
                               tmp_path / "log", lambda: 0)
    child.close()
    assert child.wait_for("one") is False


def test_a_stage_that_misses_the_cache_after_the_child_filled_it_ends_the_child(tmp_path):
    """The child's graphs differ from this process's: waiting for it would only add its compile time."""
    misses = [0]
    child = scripted_child(tmp_path, [{"stages": ["one", "two", "three"]}] + [
        {"stage": what, "ok": True, "seconds": 1} for what in ("one", "two", "three")], misses=lambda: misses[0])
    assert child.wait_for("one") is True
    child.loaded("one")  # a hit: the child goes on
    assert child.wait_for("two") is True
    misses[0] += 2  # this process compiled stage two anyway
    child.loaded("two")
    assert child.wait_for("three") is False  # ended: this process compiles three itself
