"""The serving side of the compile child reads its reports without hanging on a child that says less than
expected, fails a stage, or dies."""

from __future__ import annotations

import json
import os
import sys

from server.engine.compile_child import CompileChild


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


def test_a_stage_traces_before_it_waits_for_the_child_and_waits_once():
    """BackgroundCompile: each stage's graphs are traced (dynamo, up to the backend's `before_inductor`) before the
    stage waits for the child's report; a stage's later graphs do not wait again; a stage that reaches no compile
    does not wait at all; a compile on another thread never waits."""
    import threading

    from server.engine.background_compile import BackgroundCompile
    from server.engine.compile_child import before_inductor

    events = []

    class Child:
        def wait_for(self, what):
            events.append(f"wait {what}")
            return True

        def loaded(self, what):
            events.append(f"loaded {what}")

        def close(self):
            events.append("closed")

    def stage(what, num_graphs):
        def run():
            for graph in range(num_graphs):
                events.append(f"trace {what} {graph}")
                before_inductor()
        return what, run

    def other_thread():
        before_inductor()
        events.append("other thread compiled")

    def compile_on_another_thread():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()

    stages = [stage("one", 2), ("none", compile_on_another_thread), stage("two", 1)]
    background = BackgroundCompile(stages, "cpu", Child())
    background.start()
    assert background.join(30) and background.state == "ready"
    assert events == ["trace one 0", "wait one", "trace one 1", "loaded one", "other thread compiled", "loaded none",
                      "trace two 0", "wait two", "loaded two", "closed"]
    before_inductor()  # outside a stage: nothing to wait for
