"""An engine process's compute threads (torch's intra-op threads), fixed or following the machine's load.

torch's OpenMP threads meet at a barrier after every parallel region. When another process keeps one of
their cores busy, the thread sharing that core runs only part of the time and every barrier waits for it: with
a fixed thread count an SFT step and decoding took several times their idle time (docs/BENCHMARKS.md, "busy").
Letting waiting threads sleep (OMP_WAIT_POLICY=PASSIVE) avoids that but slows every region on an idle machine
(each wakes its threads), and one thread always halves the speed of compute-bound work.

So by default ("auto") the thread count follows the load. The busy time of the CPUs this process may use is
read from /proc/stat before and after each engine call (at most every `WINDOW` seconds), the CPU time of this
process's compute threads is subtracted (`compute_seconds`: the rest of the process, a server's event loop and
request threads, is load like another process's), and before each call the threads are set to the CPUs left free
over the last window (rounded; at least 1, at most the ceiling: `whitney serve`'s usable CPUs, a Ray worker's
CPUs). A window is the gap since the last call when that was long enough to measure, else the last call
itself: another program starting between two calls is seen by the next one, one starting during a call by
the call after. An idle machine keeps every thread. A different thread count may change how a kernel splits a
reduction, so results can differ in float32 rounding (never more) between calls made under different loads;
`whitney serve --threads N` fixes the count where bitwise repeatability matters.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from whitney.protocol.config import usable_cpu_ids

log = logging.getLogger(__name__)
WINDOW = 0.05  # seconds: the shortest window measured (/proc/stat counts in ticks of 10 ms)
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc/stat's unit, per second


def busy_seconds(cpus: set[int]) -> float | None:
    """CPU seconds these CPUs spent on anything but idling (user, nice, system, irq, softirq, and steal: time
    the hypervisor gave to another machine), all processes together, since boot; None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
    except OSError:
        return None
    busy = 0
    for name, *values in lines:
        if int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in values[:8])
            busy += user + nice + system + irq + softirq + steal
    return busy / TICKS


def own_seconds() -> float:
    """CPU seconds this process (every thread) has used."""
    t = os.times()
    return t.user + t.system


def compute_seconds(caller: int) -> float:
    """CPU seconds of this process's threads that compute for the engine: `caller` (the thread making engine
    calls; its native id), the threads Python did not start (torch's OpenMP pool), and threads whose priority is
    lowered (they yield to those: service/http/heavy.py's). The rest of the process at normal priority (a
    server's event loop and request threads) is load like another process's: it shares the cores the compute
    threads meet at barriers on. Without /proc/self/task, the whole process."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return own_seconds()
    python = {t.native_id for t in threading.enumerate()} - {caller}
    ticks = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # from field 3 (state) on: the name may hold spaces
        except OSError:
            continue  # the thread has ended
        if int(tid) in python and int(fields[16]) <= 0:  # field 19: nice
            continue
        ticks += int(fields[11]) + int(fields[12])  # fields 14 and 15: utime, stime
    return ticks / TICKS


def free_cpus(cpus: int, others_busy: float) -> int:
    """The CPUs left to this process when the others keep `others_busy` CPUs busy (rounded), at least 1."""
    return max(1, int(cpus - others_busy + 0.5))


@dataclass
class ComputeThreads:
    """This process's torch threads: `ceiling` always (fixed), or the CPUs the other processes leave free,
    at most `ceiling` (adaptive). `before_call()` and `after_call()` around each engine call."""

    ceiling: int
    adaptive: bool
    cpus: set[int] = field(default_factory=usable_cpu_ids)  # the CPUs whose load counts
    current: int = 0
    others: float = 0.0  # the CPUs the other processes kept busy over the last window
    _at: float = -1e18  # when the last reading was taken (monotonic), and its busy and own seconds
    _busy: float = 0.0
    _own: float = 0.0

    @classmethod
    def of(cls, setting: int | str | None, cpus: int) -> "ComputeThreads | None":
        """EngineConfig.threads: None leaves torch as it is (an engine made in a library), N fixes N threads,
        "auto" follows the load with `cpus` (the CPUs this process may use) as the ceiling."""
        if setting is None:
            return None
        threads = cls(cpus, adaptive=True) if setting == "auto" else cls(int(setting), adaptive=False)
        threads.set(threads.ceiling)
        return threads

    def set(self, n: int) -> None:
        import torch

        if n != self.current:
            log.debug("compute threads %d -> %d (other processes keep %.2f CPUs busy)", self.current, n, self.others)
            torch.set_num_threads(n)
            self.current = n

    def before_call(self) -> int:
        """The threads for the call about to run, from the last window's load; the count now set."""
        if self.adaptive:
            self._read()
            self.set(min(self.ceiling, free_cpus(len(self.cpus), self.others)))
        return self.current

    def after_call(self) -> None:
        """The call's own window, for the next call when the gap before it is too short to measure."""
        if self.adaptive:
            self._read()

    def _read(self) -> None:
        """A reading, if the last one is at least WINDOW old: `others` over the window since then."""
        now = time.monotonic()
        if now - self._at < WINDOW:
            return
        busy, own = busy_seconds(self.cpus), compute_seconds(threading.get_native_id())
        if busy is None:  # no /proc/stat: the ceiling, always
            self.adaptive = False
            return
        if self._at > 0:
            self.others = max(0.0, (busy - self._busy) - (own - self._own)) / (now - self._at)
        self._at, self._busy, self._own = now, busy, own
