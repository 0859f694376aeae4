"""engine/threads.py: the compute threads follow the CPUs other work leaves free (at least 1, at most the
ceiling), read from /proc/stat with the compute threads' own CPU time taken out; a fixed count never moves."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from whitney.engine import threads
from whitney.engine.threads import ComputeThreads
from whitney.errors import InvalidInput
from whitney.protocol.config import check_threads, usable_cpus


def test_free_cpus_rounds_what_the_others_leave_and_keeps_one():
    assert threads.free_cpus(2, 0.0) == 2
    assert threads.free_cpus(2, 0.3) == 2
    assert threads.free_cpus(2, 0.6) == 1
    assert threads.free_cpus(2, 1.0) == 1
    assert threads.free_cpus(2, 2.0) == 1  # never none
    assert threads.free_cpus(16, 3.2) == 13


def test_settings_none_fixed_and_auto():
    before = torch.get_num_threads()
    assert ComputeThreads.of(None, 8) is None and torch.get_num_threads() == before  # a library's engine
    fixed = ComputeThreads.of(1, 8)
    assert (fixed.ceiling, fixed.adaptive, torch.get_num_threads()) == (1, False, 1)
    assert fixed.before_call() == 1
    auto = ComputeThreads.of("auto", 2)
    assert (auto.ceiling, auto.adaptive, torch.get_num_threads()) == (2, True, 2), "auto starts at its ceiling"
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(InvalidInput) as e:
            check_threads(bad)
        assert e.value.field == "threads" and "'auto' or an integer >= 1" in e.value.message


def test_this_processs_own_work_does_not_count_and_each_window_informs_the_next_call(monkeypatch):
    """Readings faked: a window whose busy time is this process's own means no other load; a gap too short to
    measure leaves the decision to the last call's own window."""
    clock = {"busy": 100.0, "own": 10.0, "now": 1000.0}
    monkeypatch.setattr(threads, "busy_seconds", lambda cpus: clock["busy"])
    monkeypatch.setattr(threads, "compute_seconds", lambda caller: clock["own"])
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock["now"])
    auto = ComputeThreads(ceiling=2, adaptive=True, cpus={0, 1})
    auto.set(2)

    def window(seconds: float, busy: float, own: float) -> None:
        clock["now"] += seconds
        clock["busy"] += busy * seconds
        clock["own"] += own * seconds

    assert auto.before_call() == 2  # the first reading: a baseline
    for busy, own, want in ((2.0, 2.0, 2), (2.0, 1.0, 1), (1.4, 1.0, 2), (2.0, 0.2, 1), (0.0, 0.0, 2)):
        window(1.0, busy, own)  # the gap before a call: another program started (or stopped) meanwhile
        assert auto.before_call() == want, (busy, own)
    window(2.0, 2.0, 1.0)  # a call during which another program kept a core busy
    auto.after_call()
    window(0.01, 0.0, 0.0)  # the next call comes at once: its gap is too short, the call's window decides
    assert auto.before_call() == 1
    window(3.0, 2.0, 2.0)  # that call ran alone on both cores
    auto.after_call()
    window(0.01, 0.0, 0.0)
    assert auto.before_call() == 2


@pytest.mark.skipif(usable_cpus() < 2 or threads.busy_seconds({0}) is None,
                    reason="needs 2 CPUs and /proc/stat")
def test_a_process_spinning_on_a_core_takes_a_thread_away():
    """Real load: another process keeps one core busy; within a second the engine is down a thread."""
    auto = ComputeThreads.of("auto", usable_cpus())
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 20
        while auto.before_call() == auto.ceiling and time.monotonic() < deadline:
            time.sleep(0.2)
        assert auto.current < auto.ceiling, "the busy core was not given up"
    finally:
        hog.kill()
        hog.wait()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc/self/task")
def test_the_processs_other_threads_are_load_unless_their_priority_is_lowered():
    """Issue 31: a server's event loop and request threads busy with a flood of refused requests made the compute
    threads meet at barriers with a shared core (training several times slower), while the old reading took the
    whole process's CPU time out. Now only the compute threads' own time is taken out: a normal-priority thread
    of this process counts as load, a thread whose priority is lowered (the heavy checks') does not."""
    me = threading.get_native_id()
    for nice in (0, 19):
        started, stop, used = threading.Event(), threading.Event(), []

        def spin():
            if nice:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            start = time.thread_time()
            started.set()
            while not stop.is_set():
                pass
            used.append(time.thread_time() - start)

        spinner = threading.Thread(target=spin)
        spinner.start()
        started.wait()
        before = threads.compute_seconds(me)
        time.sleep(0.6)
        counted = threads.compute_seconds(me) - before  # read while the spinner still runs
        stop.set()
        spinner.join()
        if nice == 0:
            assert used[0] > 0.1 and counted < 0.05 + 0.2 * used[0], (counted, used)
        else:
            assert abs(counted - used[0]) < 0.06, (counted, used)
