"""A deterministic cooperative scheduler in virtual time, and the stand-ins kclpy runs on.

Every simulated thread is a real Python thread, but exactly one of them runs at a time: it
holds the *baton*. A thread gives the baton up only inside a blocking primitive (a sleep, a
wait on an event, lock or queue, an AWS call of the in-memory endpoints); the scheduler then
advances virtual time to the next timer if nothing is runnable, and picks the next thread
with the history's seeded RNG. Since nothing else decides who runs or what a clock reads, a
history is a pure function of its seed (and of ``PYTHONHASHSEED``, which the runner fixes).

kclpy is not changed for this: :func:`install` replaces, in the ``kclpy.*`` modules only,
the module globals ``time``, ``threading``, ``queue``, ``random``, ``uuid`` and
``ThreadPoolExecutor`` by the stand-ins below, and every function default that is
``time.monotonic``/``time.time``/``time.sleep``/``time.perf_counter`` by its virtual twin.
The stand-ins dispatch to the running :class:`Sim`, so installing once per process is enough;
a process that installed them cannot run kclpy outside a simulation any more (the runner uses
child processes for that reason).

Each thread belongs to a :class:`Node` (a worker process): a node has its own clock (bounded
skew: an offset and a rate), can be paused (SIGSTOP: none of its threads is picked until it
resumes, its timers fire late) and killed (SIGKILL: its threads never run kclpy code again;
they are unwound with :class:`Killed` at the end of the history).
"""

from __future__ import annotations

import _thread
import heapq
import queue as _queue
import random as _random
import sys
import threading as _threading
import time as _time
import types
import uuid as _uuid
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

_get_ident = _thread.get_ident

#: the wall clock of virtual time 0 (epoch seconds): arrival timestamps and lag use it
EPOCH = 1_800_000_000.0


class Killed(BaseException):
    """Unwinds a thread of a killed node (or of a finished history). A BaseException so
    that no ``except Exception`` in kclpy can swallow it."""


class Node:
    """One simulated process: its clock and whether it runs."""

    def __init__(self, name: str, *, offset: float = 0.0, rate: float = 1.0) -> None:
        self.name = name
        self.offset = offset
        self.rate = rate
        self.paused_until = 0.0
        self.killed = False

    def clock(self, now: float) -> float:
        return self.offset + now * self.rate


class Task:
    """One simulated thread."""

    def __init__(self, sim: Sim, name: str, node: Node, target: Callable[[], object]) -> None:
        self.sim = sim
        self.name = name
        self.node = node
        self.target = target
        self.baton = _thread.allocate_lock()
        self.baton.acquire()
        self.done = False
        self.killed = False
        #: bumped each time the task blocks or wakes, so stale timers are ignored
        self.generation = 0
        self.timed_out = False
        self.joiners: list[Task] = []
        #: the identity of the real thread (a :class:`_Carrier`) that runs this task
        self.ident: int | None = None


class _Carrier:
    """A real thread that runs simulated threads one after another. A history starts about a
    hundred of them and a child process runs hundreds of histories; starting and joining a
    real thread for each was a few per cent of a history's CPU, so a finished task's thread
    waits in :data:`_IDLE` for the next one. Nothing of a task outlives it on its carrier:
    kclpy keeps no thread-local state (``threading.local``) in the modules that run here."""

    def __init__(self) -> None:
        self.sim: Sim | None = None
        self.task: Task | None = None
        self._assigned = _thread.allocate_lock()
        self._assigned.acquire()
        thread = _threading.Thread(target=self._loop, name="sim-carrier", daemon=True)
        thread.start()
        assert thread.ident is not None
        self.ident: int = thread.ident

    def carry(self, sim: Sim, task: Task) -> None:
        self.sim, self.task = sim, task
        task.ident = self.ident
        self._assigned.release()

    def _loop(self) -> None:
        while True:
            self._assigned.acquire()
            sim, task = self.sim, self.task
            assert sim is not None and task is not None
            self.sim = self.task = None
            sim._body(task)
            del sim, task  # an idle carrier keeps nothing of a finished history alive
            # The body's last act handed the baton on, so a spawn may already have missed
            # this carrier and started another: harmless, the pool only grows to the most
            # tasks alive at once.
            _IDLE.append(self)


#: carriers waiting for a task (appended and popped under the GIL: no lock needed)
_IDLE: deque[_Carrier] = deque()


class Sim:
    """The scheduler of one history."""

    def __init__(self, seed: int, *, trace: bool = False) -> None:
        self.seed = seed
        self.rng = _random.Random(seed)
        self.now = 0.0
        self._seq = 0
        self._runnable: list[Task] = []
        self._timers: list[tuple[float, int, Task, int]] = []
        self._wakeups: list[tuple[float, int, Callable[[], None]]] = []
        self.tasks: list[Task] = []
        self.current: Task | None = None
        self._main = _thread.allocate_lock()
        self._main.acquire()
        self.switches = 0
        self.stop_at = float("inf")
        self.error: BaseException | None = None
        self.trace: list[str] | None = [] if trace else None
        #: the latest end of any node's pause: until then ``_pick`` filters paused nodes
        self._paused_until = 0.0

    # -- threads ------------------------------------------------------------------------

    def spawn(self, name: str, target: Callable[[], object], node: Node | None = None) -> Task:
        parent = self.current
        task = Task(self, name, node or (parent.node if parent else Node("sim")), target)
        self.tasks.append(task)
        (_IDLE.pop() if _IDLE else _Carrier()).carry(self, task)
        if task.node.killed:
            task.killed = True
        else:
            self._runnable.append(task)
        return task

    def _body(self, task: Task) -> None:
        task.baton.acquire()
        try:
            if not task.killed:
                task.target()
        except Killed:
            pass
        except BaseException as exc:
            if self.error is None and not task.node.killed:
                self.error = exc
        finally:
            task.done = True
            for joiner in task.joiners:
                self.wake(joiner)
            task.joiners.clear()
            if self._unwinding or task is self.controller:
                self.current = None
                self._main.release()
            else:
                self._hand_on(None)

    _unwinding = False
    controller: Task | None = None

    def run(self, main: Callable[[], object], until: float) -> None:
        """Run ``main`` (the history's controller) until it returns or virtual time passes
        ``until``; then unwind every thread left."""
        self.stop_at = until
        controller = self.spawn("controller", main, Node("controller"))
        self.controller = controller
        self._runnable.remove(controller)
        self.current = controller
        controller.baton.release()
        self._main.acquire()
        self._unwinding = True
        for task in list(self.tasks):
            if not task.done:
                task.killed = True
                self.current = task
                task.baton.release()
                self._main.acquire()

    # -- the baton ----------------------------------------------------------------------

    def _pick(self) -> Task | None:
        while True:
            runnable = self._runnable
            if self._paused_until <= self.now:  # no node paused: every runnable task
                if runnable:
                    return runnable.pop(self.rng.randrange(len(runnable))
                                        if len(runnable) > 1 else 0)
            else:
                candidates = [t for t in runnable if t.node.paused_until <= self.now]
                if candidates:
                    task = candidates[self.rng.randrange(len(candidates))] if len(
                        candidates) > 1 else candidates[0]
                    runnable.remove(task)
                    return task
            nxt = self._next_event()
            if nxt is None or nxt > self.stop_at:
                return None
            self.now = max(self.now, nxt)
            self._fire()

    def _next_event(self) -> float | None:
        while self._timers and self._timers[0][2].generation != self._timers[0][3]:
            heapq.heappop(self._timers)
        times = []
        if self._timers:
            times.append(self._timers[0][0])
        if self._wakeups:
            times.append(self._wakeups[0][0])
        if self._paused_until > self.now:
            times.extend(t.node.paused_until for t in self._runnable
                         if t.node.paused_until > self.now)
        return min(times) if times else None

    def _fire(self) -> None:
        while self._timers and self._timers[0][0] <= self.now:
            _, _, task, generation = heapq.heappop(self._timers)
            if task.generation == generation:
                task.generation += 1
                task.timed_out = True
                self._runnable.append(task)
        while self._wakeups and self._wakeups[0][0] <= self.now:
            _, _, fn = heapq.heappop(self._wakeups)
            fn()

    def _hand_on(self, me: Task | None) -> None:
        """Give the baton to the next thread (``me`` keeps it if it is picked)."""
        nxt = self._pick()
        self.switches += 1
        if nxt is me:
            return
        if nxt is None:
            self.current = None
            self._main.release()
        else:
            self.current = nxt
            nxt.baton.release()
        if me is not None:
            me.baton.acquire()
            self.current = me

    def me(self) -> Task:
        task = self.current
        if task is None or task.ident != _get_ident():
            raise RuntimeError("a simulated primitive was used outside a simulated thread")
        if task.killed:
            raise Killed
        return task

    def block(self, timeout: float | None) -> bool:
        """Give the baton up until woken (True) or ``timeout`` node-seconds passed (False)."""
        task = self.me()
        task.generation += 1
        task.timed_out = False
        if timeout is not None:
            self._seq += 1
            # at least a microsecond: a wait for what is left of a deadline must move time on
            # even when float rounding leaves a remainder too small to add to ``now``
            due = self.now + max(1e-6, timeout / task.node.rate)
            heapq.heappush(self._timers, (due, self._seq, task, task.generation))
        self._hand_on(task)
        if task.killed:
            raise Killed
        return not task.timed_out

    def wake(self, task: Task) -> None:
        """Make a blocked task runnable (it was not woken by its timer)."""
        if task.done or task in self._runnable:
            return
        task.generation += 1
        task.timed_out = False
        if not task.killed:
            self._runnable.append(task)

    def yield_now(self) -> None:
        """Let another runnable thread go first (a scheduling point without waiting)."""
        task = self.me()
        task.generation += 1
        self._runnable.append(task)
        self._hand_on(task)
        if task.killed:
            raise Killed

    def sleep(self, seconds: float) -> None:
        self.block(max(0.0, seconds))

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` (it must not block) when virtual time reaches ``when``."""
        self._seq += 1
        heapq.heappush(self._wakeups, (when, self._seq, fn))

    # -- clocks --------------------------------------------------------------------------

    def node_now(self) -> float:
        task = self.current
        node = task.node if task is not None else None
        return node.clock(self.now) if node is not None else self.now

    def log(self, message: str) -> None:
        if self.trace is not None:
            node = self.current.node.name if self.current is not None else "-"
            self.trace.append(f"{self.now:9.3f} {node:>10} {message}")

    def kill(self, node: Node) -> None:
        node.killed = True
        for task in self.tasks:
            if task.node is node and not task.done:
                task.killed = True
                if task in self._runnable:
                    self._runnable.remove(task)

    def pause(self, node: Node, seconds: float) -> None:
        node.paused_until = max(node.paused_until, self.now + seconds)
        self._paused_until = max(self._paused_until, node.paused_until)


#: the simulation running in this process (the stand-ins dispatch to it)
ACTIVE: Sim | None = None


def _sim() -> Sim:
    if ACTIVE is None:
        raise RuntimeError("no simulation is running")
    return ACTIVE


# -- the stand-ins ---------------------------------------------------------------------------


def monotonic() -> float:
    sim = ACTIVE
    if sim is None:
        raise RuntimeError("no simulation is running")
    task = sim.current  # Sim.node_now, inlined: kclpy reads its clocks very often
    if task is None:
        return sim.now
    node = task.node
    return node.offset + sim.now * node.rate


def wall_time() -> float:
    return EPOCH + monotonic()


def sleep(seconds: float) -> None:
    _sim().sleep(seconds)


class Lock:
    """threading.Lock in virtual time; waiters are served first come, first served."""

    def __init__(self) -> None:
        self._owner: Task | None = None
        self._waiters: deque[Task] = deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        sim = _sim()
        me = sim.me()
        if self._owner is None:
            self._owner = me
            return True
        if not blocking:
            return False
        self._waiters.append(me)
        sim.block(None if timeout is None or timeout < 0 else timeout)
        if self._owner is me:
            return True
        self._waiters.remove(me)
        return False

    def release(self) -> None:
        if self._owner is None:
            raise RuntimeError("release unlocked lock")
        self._owner = None
        while self._waiters:
            nxt = self._waiters.popleft()
            if nxt.killed or nxt.done:
                continue
            self._owner = nxt
            _sim().wake(nxt)
            return

    def locked(self) -> bool:
        return self._owner is not None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class RLock(Lock):
    def __init__(self) -> None:
        super().__init__()
        self._depth = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._owner is not None and self._owner is _sim().current:
            self._depth += 1
            return True
        got = super().acquire(blocking, timeout)
        if got:
            self._depth = 1
        return got

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            super().release()


class Event:
    def __init__(self) -> None:
        self._flag = False
        self._waiters: list[Task] = []

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        waiters, self._waiters = self._waiters, []
        sim = _sim()
        for task in waiters:
            sim.wake(task)

    def clear(self) -> None:
        self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        sim = _sim()
        me = sim.me()
        self._waiters.append(me)
        try:
            woken = sim.block(timeout)
        finally:
            if me in self._waiters:
                self._waiters.remove(me)
        return woken or self._flag


class Condition:
    def __init__(self, lock: Lock | None = None) -> None:
        self._lock = lock if lock is not None else RLock()
        self._waiters: list[Task] = []

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        sim = _sim()
        me = sim.me()
        self._waiters.append(me)
        self._lock.release()
        try:
            woken = sim.block(timeout)
        finally:
            if me in self._waiters:
                self._waiters.remove(me)
            self._lock.acquire()
        return woken

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        end = None if timeout is None else monotonic() + timeout
        result = predicate()
        while not result:
            left = None if end is None else end - monotonic()
            if left is not None and left <= 0:
                break
            self.wait(left)
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        for task in self._waiters[:n]:
            self._waiters.remove(task)
            _sim().wake(task)

    def notify_all(self) -> None:
        self.notify(len(self._waiters))


class Thread:
    """threading.Thread on the scheduler; the new thread belongs to its creator's node."""

    def __init__(self, group: None = None, target: Callable[..., object] | None = None,
                 name: str | None = None, args: Iterable[Any] = (),
                 kwargs: dict[str, Any] | None = None, *, daemon: bool | None = None) -> None:
        self.name = name or "thread"
        self.daemon = bool(daemon)
        self._target = target
        self._args = tuple(args)
        self._kwargs = kwargs or {}
        self._task: Task | None = None

    def run(self) -> None:
        if self._target is not None:
            self._target(*self._args, **self._kwargs)

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("threads can only be started once")
        self._task = _sim().spawn(self.name, self.run)

    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done

    def join(self, timeout: float | None = None) -> None:
        task = self._task
        if task is None:
            raise RuntimeError("cannot join thread before it is started")
        sim = _sim()
        end = None if timeout is None else monotonic() + timeout
        while not task.done:
            me = sim.me()
            task.joiners.append(me)
            left = None if end is None else end - monotonic()
            if left is not None and left <= 0:
                task.joiners.remove(me)
                return
            sim.block(left)
            if me in task.joiners:
                task.joiners.remove(me)


class Semaphore:
    def __init__(self, value: int = 1) -> None:
        self._value = value
        self._changed = Condition(Lock())

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        with self._changed:
            if not blocking and self._value == 0:
                return False
            if not self._changed.wait_for(lambda: self._value > 0, timeout):
                return False
            self._value -= 1
            return True

    def release(self, n: int = 1) -> None:
        with self._changed:
            self._value += n
            self._changed.notify(n)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class Timer(Thread):
    """threading.Timer: ``function`` runs after ``interval`` unless cancelled first."""

    def __init__(self, interval: float, function: Callable[..., object],
                 args: Iterable[Any] | None = None,
                 kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(name="timer", daemon=True)
        self._interval = interval
        self._function = function
        self._fargs = tuple(args or ())
        self._fkwargs = kwargs or {}
        self.finished = Event()

    def cancel(self) -> None:
        self.finished.set()

    def run(self) -> None:
        if not self.finished.wait(self._interval):
            self._function(*self._fargs, **self._fkwargs)
        self.finished.set()


class _ThreadingModule(types.ModuleType):
    Thread = Thread
    Event = Event
    Lock = Lock
    RLock = RLock
    Condition = Condition
    Semaphore = Semaphore
    BoundedSemaphore = Semaphore
    Timer = Timer

    @staticmethod
    def current_thread() -> _threading.Thread:
        return _threading.current_thread()

    @staticmethod
    def main_thread() -> _threading.Thread:
        return _threading.main_thread()

    def __getattr__(self, name: str) -> Any:
        return getattr(_threading, name)


class Queue:
    """queue.Queue in virtual time."""

    def __init__(self, maxsize: int = 0) -> None:
        self.maxsize = maxsize
        self._items: deque[object] = deque()
        self._readers = Event()
        self._writers = Event()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return 0 < self.maxsize <= len(self._items)

    def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
        end = None if timeout is None else monotonic() + timeout
        while self.full():
            if not block:
                raise _queue.Full
            left = None if end is None else end - monotonic()
            if left is not None and left <= 0:
                raise _queue.Full
            self._writers.clear()
            self._writers.wait(left)
        self._items.append(item)
        self._readers.set()

    def put_nowait(self, item: object) -> None:
        self.put(item, block=False)

    def get(self, block: bool = True, timeout: float | None = None) -> object:
        end = None if timeout is None else monotonic() + timeout
        while not self._items:
            if not block:
                raise _queue.Empty
            left = None if end is None else end - monotonic()
            if left is not None and left <= 0:
                raise _queue.Empty
            self._readers.clear()
            self._readers.wait(left)
        item = self._items.popleft()
        self._writers.set()
        return item

    def get_nowait(self) -> object:
        return self.get(block=False)


class _QueueModule(types.ModuleType):
    Queue = Queue
    Empty = _queue.Empty
    Full = _queue.Full


def _ns(clock: Callable[[], float]) -> Callable[[], int]:
    return lambda: int(clock() * 1e9)


class _TimeModule(types.ModuleType):
    monotonic = staticmethod(monotonic)
    perf_counter = staticmethod(monotonic)
    time = staticmethod(wall_time)
    sleep = staticmethod(sleep)
    monotonic_ns = staticmethod(_ns(monotonic))
    perf_counter_ns = staticmethod(_ns(monotonic))
    time_ns = staticmethod(_ns(wall_time))

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)


def _seeded_random(seed: int | None = None) -> _random.Random:
    return _random.Random(_sim().rng.getrandbits(64) if seed is None else seed)


class _RandomModule(types.ModuleType):
    Random = staticmethod(_seeded_random)

    def __getattr__(self, name: str) -> Any:
        return getattr(_sim().rng, name)


class _UuidModule(types.ModuleType):
    @staticmethod
    def uuid4() -> _uuid.UUID:
        return _uuid.UUID(int=_sim().rng.getrandbits(128), version=4)

    def __getattr__(self, name: str) -> Any:
        return getattr(_uuid, name)


class Future:
    """concurrent.futures.Future in virtual time (what ``submit`` returns)."""

    def __init__(self) -> None:
        self._done = Event()
        self._result: Any = None
        self._exception: BaseException | None = None

    def set_result(self, result: Any) -> None:
        self._result = result
        self._done.set()

    def set_exception(self, exception: BaseException) -> None:
        self._exception = exception
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done.wait(timeout):
            raise TimeoutError
        return self._exception


class ThreadPoolExecutor:
    """The renewer's pool: ``map`` runs each call on its own simulated thread and, as the
    real pool does, returns once every call finished."""

    def __init__(self, max_workers: int | None = None, thread_name_prefix: str = "") -> None:
        self._prefix = thread_name_prefix or "pool"

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        results: dict[int, Any] = {}
        errors: list[BaseException] = []
        threads = []
        for index, item in enumerate(items):
            def call(index: int = index, item: Any = item) -> None:
                try:
                    results[index] = fn(item)
                except Exception as exc:
                    errors.append(exc)
            thread = Thread(target=call, name=f"{self._prefix}-{index}")
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return [results[i] for i in sorted(results)]

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        future = Future()

        def call() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except Exception as exc:
                future.set_exception(exc)

        thread = Thread(target=call, name=f"{self._prefix}-submit")
        thread.start()
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to stop: every call runs on its own simulated thread."""


_REPLACED = {
    "time": _TimeModule("time"),
    "threading": _ThreadingModule("threading"),
    "queue": _QueueModule("queue"),
    "random": _RandomModule("random"),
    "uuid": _UuidModule("uuid"),
}
_REAL_MODULES = {"time": _time, "threading": _threading, "queue": _queue, "random": _random,
                 "uuid": _uuid}
_DEFAULTS: dict[int, Callable[..., Any]] = {
    id(_time.monotonic): monotonic, id(_time.time): wall_time, id(_time.sleep): sleep,
    id(_time.perf_counter): monotonic,
}
_installed = False


def _patch_defaults(fn: object) -> None:
    func = getattr(fn, "__func__", fn)
    if not isinstance(func, types.FunctionType):
        return
    if func.__defaults__:
        func.__defaults__ = tuple(_DEFAULTS.get(id(d), d) for d in func.__defaults__)
    if func.__kwdefaults__:
        func.__kwdefaults__ = {k: _DEFAULTS.get(id(v), v) for k, v in func.__kwdefaults__.items()}


def install() -> None:
    """Put the stand-ins into every loaded ``kclpy`` module (once per process)."""
    global _installed
    if _installed:
        return
    # loads everything the worker uses, and the operator's commands (grown world)
    import kclpy.ops.commands
    import kclpy.spark.sink  # the micro-batch path (tests/simulation/microbatch.py)
    import kclpy.worker  # noqa: F401

    for name, module in list(sys.modules.items()):
        if not (name == "kclpy" or name.startswith("kclpy.")) or module is None:
            continue
        if name.startswith(("kclpy.spark", "kclpy.local", "kclpy.multilang")) and name not in (
                "kclpy.spark.batcher", "kclpy.spark.sink"):
            continue
        namespace = vars(module)
        for attr, real in _REAL_MODULES.items():
            if namespace.get(attr) is real:
                setattr(module, attr, _REPLACED[attr])
        if "ThreadPoolExecutor" in namespace:
            module.ThreadPoolExecutor = ThreadPoolExecutor  # type: ignore[attr-defined]
        for value in list(namespace.values()):
            if isinstance(value, types.FunctionType) and value.__module__ == name:
                _patch_defaults(value)
            elif isinstance(value, type) and value.__module__ == name:
                for member in vars(value).values():
                    _patch_defaults(member)
                    if isinstance(member, property):
                        for accessor in (member.fget, member.fset):
                            _patch_defaults(accessor)
    _installed = True
