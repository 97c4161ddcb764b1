"""``NodeReads``: a client's node read path, the default. Every handle of one process on one service (one coordinator
actor) shares one :class:`ProcessReads`: one lease cache, one read call in flight per step and one set of unsent
cursor moves. The process calls this node's reader (server/node_reader.py) about once per run of steps it hands
out, however many handles (ranks, consumers) the process holds.

    rank threads, any handle ──refs(s)──► ProcessReads: LeaseCache (lease_cache.py) ── hit: no call ──► StepRefs
                                   │ miss: one read call per process (threads needing s wait for it), carrying
                                   │ the cursor moves of every handle of the process since its last call
                                   ▼
                              NodeReader(this node).read(s, moves) ──► steps s, s + 1, ... (up to window)

Why per process, not per handle: a read reply is the same for every consumer (refs of produced steps; only the
cursors differ, and moves carry their consumer), so a second handle's call would fetch what the first one holds.
Each node-reader call costs it about 0.7-1 CPU-ms of Ray's per-call work (docs/scaling.md), so calls are the cost.

Guarantees:
- Rows: the refs handed out are the ones the node reader filed, unchanged.
- No wait at the end of a run: when a tracked read finds fewer than ``window // 8`` (at least 1) steps after it
  in the cache, the process's next read call starts in the background with its cursor moves, so the producers
  move the window on while the ranks still hold steps (32 ranks in lock-step, one per process: the longest data
  wait after step 0 13-19 ms, against 146-150 ms at the window's edges without it; docs/scaling.md). Its failure
  is nobody's: a rank that joined it asks again itself.
- Cursors stay exact: a move is recorded when a rank reads a step with ``track=True`` or calls
  ``DataService.advance``, and travels to the node reader with the process's next read call. Moves that wait
  longer than ``keepalive_s`` (``consumer_ttl_s / 8``, at most 15 s) for one are sent alone, so a rank reading from
  the cache stays heard well within its TTL; while a read waits for its step, new moves go at once (the step may
  wait for exactly them), and the ranks waiting are heard again every ``consumer_ttl_s / 4``. When a lease at the
  node reader waits (another rank or consumer of the node is held back), the node reader asks for them: each
  process keeps one long poll open (``NodeReader.demand``, no CPU while it waits) and sends its unsent moves when
  it answers. A cursor never runs ahead of the rank.
- Thread-safe: every field is guarded by one lock, never held across a remote call; threads that need the same
  step share one call, whichever handle they read through.
- The node reader is found (and started) by :meth:`warm`, which ``DataService.connect`` calls: a fresh loader's
  first read does not wait for an actor to start.
Limits: the coordinator sees a rank's moves up to one run (about ``window / 2`` steps in lock-step) plus the
node reader's next lease late; a read-ahead holds a thread of the process until its step is made (at most
``request_timeout_s``); ``commit`` and ``status`` carry this client's own moves, so they are exact for it.
Sharing helps only processes with several handles (the benchmark's 32 rank threads per process, notebooks, a
process serving several consumers); a trainer with one rank per process makes one call per run either way.
Call :func:`stop_background` before ``ray.shutdown()`` (session.py does).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import ray

from zephon_ray.errors import best_effort
from zephon_ray.service.client.step_refs import StepRefs, call
from zephon_ray.service.errors import ReplyTimeoutError, describe
from zephon_ray.service.lease_cache import LeaseCache
from zephon_ray.service.wire import CursorMove, HeldStep, Reply, only_lanes

log = logging.getLogger("zephon_ray")

WAIT_POLL_S = 0.25
"""While a read call waits, how often the process's new moves and keep-alives are looked at."""
READ_AHEAD_PER_WINDOW = 8
"""A tracked read that finds fewer than ``window // 8`` (at least 1) steps after it in the process's cache starts
the process's next read call in the background (``ProcessReads._read_ahead``): that many steps' time to get the
next steps made and here. One rank per process, window 8 (1 step ahead): 4-9 % more calls than without
read-aheads and no wait at the window's edge; 2 steps ahead made 16-20 % more (shorter runs). Measured with
benchmarks/bench_service_load.py (docs/scaling.md)."""
DEMAND_POLL_S = 60.0
"""A process's long poll for demand (``NodeReader.demand``, server/node_reader.py) returns at least this often."""


class _Listener:
    """One long poll per process and node reader: when a lease at the node reader has waited a while, it answers,
    and every handle of this process on that node sends its unsent cursor moves (the step may wait for them)."""

    def __init__(self, key: Any, reader: Any) -> None:
        self.key = key
        self.reader = reader
        self.clients: weakref.WeakSet = weakref.WeakSet()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="zephon-ray-demand", daemon=True)

    def _run(self) -> None:
        epoch = 0
        while True:
            with _LISTENERS_LOCK:
                if not self.clients:
                    _LISTENERS.pop(self.key, None)
                    return
            try:
                # No retries: a call to a reader that died must fail, not wait for it to come back (it may not).
                call = self.reader.demand.options(max_task_retries=0).remote(epoch, DEMAND_POLL_S)
                new = self._answer(call)
            except BaseException:  # noqa: BLE001 - the reader is gone or stuck (handles listen again on their next
                # move), or this worker process is exiting (Ray raises SystemExit in its threads' calls)
                new = None
            if new is None:
                with _LISTENERS_LOCK:
                    if _LISTENERS.get(self.key) is self:
                        del _LISTENERS[self.key]
                    clients = list(self.clients)
                for client in clients:
                    client._stop_listening(self.reader)
                return
            if new != epoch:
                epoch = new
                for client in list(self.clients):
                    client.flush()

    def _answer(self, call: Any) -> int | None:
        """The long poll's answer; None once stopped or once Ray is shut down. It waits in short slices, never in
        one long ``ray.get``: a thread that calls into Ray after ``ray.shutdown()`` makes Ray end the whole process
        with exit code 1 (seen as ``ray job submit`` drivers failing after their last line; tests/test_service_job.py)."""
        deadline = time.monotonic() + DEMAND_POLL_S + 60
        while not self.stopped.is_set() and ray.is_initialized():
            ready, _ = ray.wait([call], timeout=STOP_POLL_S)
            if ready:
                return ray.get(ready[0], timeout=STOP_POLL_S + 30)  # answered: only its small value to read
            if time.monotonic() > deadline:
                raise TimeoutError("the node reader's demand poll did not answer")
        return None


_LISTENERS: dict[Any, _Listener] = {}
_LISTENERS_LOCK = threading.Lock()
_HANDLES: weakref.WeakSet = weakref.WeakSet()
"""Every node path of this process: their keep-alive timers stop with the polls."""
STOP_POLL_S = 0.5
"""How soon a demand poll notices ``stop_background``."""


def stop_background(timeout_s: float = 5.0) -> None:
    """Stop this process's background Ray calls (demand polls, keep-alive timers) and wait for the polls to end.

    Call it before ``ray.shutdown()`` (``zephon_ray.service.client.session.ray_session`` does); it also runs at
    exit, before Ray's own exit hook (registered after ``ray.init``, and atexit runs in reverse). Unsent cursor
    moves are dropped. Handles used after a new ``ray.init`` listen again on their next move."""
    with _LISTENERS_LOCK:
        listeners = list(_LISTENERS.values())
        _LISTENERS.clear()
    for listener in listeners:
        listener.stopped.set()
    handles = list(_HANDLES)
    for handle in handles:
        handle.quiesce()
    for listener in listeners:
        if listener.thread is not threading.current_thread():
            listener.thread.join(timeout_s)
    for handle in handles:
        handle.join_background(timeout_s)


_EXIT_HOOKED = threading.Event()


def _listen(reader: Any, client: ProcessReads) -> None:
    key = getattr(reader, "_actor_id", None) or id(reader)
    with _LISTENERS_LOCK:
        listener = _LISTENERS.get(key)
        start = listener is None
        if listener is None:
            listener = _LISTENERS[key] = _Listener(key, reader)
        listener.clients.add(client)
    if start:
        if not _EXIT_HOOKED.is_set():
            _EXIT_HOOKED.set()
            atexit.register(stop_background)
        listener.thread.start()


def _cancel(ref: Any, timeout_s: float = 2.0) -> None:
    """Cancel a read call that nobody waits for any more, and wait (briefly) until the node reader let it go: a call
    still pending when its actor is killed makes Ray print a task failure on the driver's stdout (seen as a line too
    many in tests/test_service_cli.py's digests)."""
    with best_effort(log, "the reader is gone already"):
        ray.cancel(ref)
        ray.wait([ref], timeout=timeout_s, fetch_local=False)


class _ReadAheadStopped(Exception):
    """A read-ahead gave up its wait: this process's background calls are stopping (``stop_background``)."""


@dataclass
class _Request:
    """One read call to the node reader in flight; threads of this process needing ``step`` wait for it."""

    step: int
    lo: int
    hi: int
    done: threading.Event
    error: BaseException | None = None
    waiting: set = field(default_factory=set)
    """(consumer, rank, world) of the tracked reads waiting for it: they are kept alive while it waits."""
    ahead: str | None = None
    """The consumer of a read-ahead (``ProcessReads._read_ahead``): no rank asked for it yet, so its failure is
    nobody's error; a rank that joined it asks again itself. None for a rank's own call."""
    stopped: bool = False
    """A read-ahead whose consumer was released or whose service is stopping: it gives up its wait."""


class ProcessReads:
    """The node path shared by every handle of this process on one service (one coordinator actor): one lease
    cache, one read call in flight per step, one set of unsent cursor moves keyed by (consumer, rank, world), so a
    process's handles cost the node reader what one handle does. See the module docstring."""

    def __init__(self, coordinator: Any, where: str, config: Any, lanes: int) -> None:
        self._coordinator = coordinator
        self._where = where
        self.config = config
        self.keepalive_s = max(0.25, min(config.consumer_ttl_s / 8, 15.0))
        self._lock = threading.Lock()
        self._reader: Any = None
        self._cache = LeaseCache.for_window(lanes, config.window, config.lease_steps)
        self._requests: list[_Request] = []
        self._lo, self._hi = lanes, 0  # union of the lanes this process's ranks asked for
        # (consumer, rank, world) -> (step, when): moves not sent yet, of every handle of this process
        self._pending: dict[tuple[str, int, int], tuple[int, float]] = {}
        self._timer: threading.Timer | None = None
        self._sent = 0.0  # when moves last left with a call
        self._listening: Any = None  # the reader this path listens to for demand (one long poll per process)
        self.ahead_steps = max(1, config.window // READ_AHEAD_PER_WINDOW)
        self._ahead_threads: set[threading.Thread] = set()
        self._stopping = threading.Event()  # set by quiesce() of every consumer: no new read-ahead
        _HANDLES.add(self)

    # ------------------------------------------------------------------ the node reader
    def reader(self) -> Any:
        """This node's reader (the coordinator starts it on first use)."""
        with self._lock:
            reader = self._reader
        if reader is None:
            node = ray.get_runtime_context().get_node_id()
            reader = call(self._coordinator.node_reader.remote(node), self._where, timeout=120)
            with self._lock:
                self._reader = self._reader or reader
                reader = self._reader
        return reader

    def warm(self, timeout_s: float = 120.0) -> None:
        """Find this node's reader and wait until its actor answers."""
        call(self.reader().info.remote(), self._where, timeout=timeout_s)

    def reset(self) -> None:
        """After a reconnect: a new coordinator incarnation has new node readers and may start below the old one."""
        with self._lock:
            self._reader = None
            self._listening = None
            self._cache.clear()

    # ------------------------------------------------------------------ reads
    def held(
        self,
        consumer: str,
        step: int,
        rank: int,
        world: int,
        lo: int,
        hi: int,
        track: bool,
        timeout_s: float,
        deadline: float,
    ) -> HeldStep:
        """This process's refs of ``step`` covering lanes ``[lo, hi)``: from its cache, from a call in flight of
        another thread (of any handle), or from one call to the node reader (which answers for a run of steps).
        ``timeout_s`` bounds the coordinator's wait for the step; ``deadline`` (``time.monotonic()``) bounds every
        wait here, past it a :class:`ReplyTimeoutError` names the step and what it waited for."""
        key = (consumer, rank, world)
        if track:
            self.advance(consumer, rank, world, step)  # travels with the request: the step may wait for this move
        while True:
            with self._lock:
                held = self._cache.get(step, lo, hi)
                if held is not None:
                    if track:
                        self._read_ahead(step, consumer, lo, hi)
                    return held
                self._lo, self._hi = min(self._lo, lo), max(self._hi, hi)
                request = self._in_flight(step, lo, hi)
                owner = request is None
                if request is None:
                    request = _Request(step, self._lo, self._hi, threading.Event())
                    self._requests.append(request)
                    moves = self._take_pending()
                if track:
                    request.waiting.add(key)
            if owner:
                self._call(request, consumer, track, timeout_s, deadline, moves)
                continue
            since = time.monotonic()
            if not request.done.wait(max(0.0, deadline - since)):
                whose = "this process's read-ahead call" if request.ahead else "another thread's read call"
                raise ReplyTimeoutError(
                    f"service {self._where}: step {step} was not served within {time.monotonic() - since:.0f}s "
                    f"(waited for {whose} that asked for it)"
                )
            if request.error is not None and request.ahead is None and not isinstance(request.error, ReplyTimeoutError):
                raise request.error  # the service's answer about this step (a refusal, a lost service)
            # a read-ahead, or a call that gave up at its own deadline: ask again ourselves (this read's deadline
            # bounds that too)

    def _in_flight(self, step: int, lo: int, hi: int) -> _Request | None:
        """(lock held) The read call in flight that will bring ``step``'s lanes ``[lo, hi)``, if any."""
        return next((q for q in self._requests if q.step == step and q.lo <= lo and hi <= q.hi), None)

    def _call(
        self, request: _Request, consumer: str, track: bool, timeout_s: float, deadline: float, moves: list[CursorMove]
    ) -> None:
        """One read call to the node reader for ``request``, its reply filed in the cache; the threads waiting for
        it are woken either way. A read-ahead's failure is only logged (a rank that joined it asks again); one
        that gives up is cancelled at the node reader, and is never retried on a restarted one (no rank waits
        for it). A refused read's cursor moves are not sent again (they would be refused again, forever)."""
        ref = None
        try:
            read = self.reader().read
            if request.ahead is not None:
                read = read.options(max_task_retries=0)
            ref = read.remote(request.step, consumer, (request.lo, request.hi), track, timeout_s, moves)
            reply = self._wait(ref, request, deadline)
            with self._lock:
                self._cache.file(reply.steps, reply.keep_from)
        except BaseException as exc:
            request.error = exc
            refused = isinstance(exc, ValueError)  # the coordinator refused this step (and any move to it or past)
            self._requeue([m for m in moves if not (refused and m[3] >= request.step)])
            if isinstance(exc, (_ReadAheadStopped, ReplyTimeoutError)) and ref is not None and ray.is_initialized():
                _cancel(ref)  # nobody waits for it any more
            if request.ahead is None:
                raise
            log.debug("read-ahead of step %d ended: %s", request.step, describe(exc))
        finally:
            with self._lock:
                self._requests.remove(request)
            request.done.set()

    def _read_ahead(self, step: int, consumer: str, lo: int, hi: int) -> None:
        """(lock held) A tracked read of ``step`` hit the cache: when fewer than ``ahead_steps`` steps after it are
        held, ask the node reader for the next ones now, in the background, with this process's cursor moves.
        Why: the moves reach the coordinator while the ranks still have steps in hand, so the producers move the
        window on before the ranks run out (without it a process's moves travel only with the call it makes once
        its run is used up, and every rank waits there for the report and the next step's production:
        benchmarks/bench_service_load.py, docs/scaling.md). It is the call the process would make a few steps
        later anyway, and waits like a tracked read (producers will get there: the cursor is a few steps behind),
        within the service's ``read_timeout_s``."""
        first = next(
            (s for s in range(step + 1, step + 1 + self.ahead_steps) if self._cache.get(s, lo, hi) is None), None
        )
        if first is None or self._stopping.is_set() or self._in_flight(first, lo, hi) is not None:
            return
        request = _Request(first, self._lo, self._hi, threading.Event(), ahead=consumer)
        self._requests.append(request)
        thread = threading.Thread(
            target=self._ahead,
            args=(request, consumer, self._take_pending()),
            name="zephon-ray-read-ahead",
            daemon=True,
        )
        self._ahead_threads.add(thread)
        thread.start()

    def _ahead(self, request: _Request, consumer: str, moves: list[CursorMove]) -> None:
        """A read-ahead's call (its thread): ``consumer`` is ``request.ahead``."""
        timeout_s = self.config.read_timeout_s
        try:
            self._call(
                request,
                consumer,
                True,
                min(timeout_s, self.config.request_timeout_s),
                time.monotonic() + timeout_s,
                moves,
            )
        finally:
            with self._lock:
                self._ahead_threads.discard(threading.current_thread())

    def _wait(self, ref: Any, request: _Request, deadline: float) -> Reply:
        """The reply of a read call, or a :class:`ReplyTimeoutError` at ``deadline``. While it waits, this
        process's new cursor moves go to the node reader (the step it waits for may be held back by exactly those
        moves), and the tracked reads waiting for it are heard again every ``consumer_ttl_s / 4``: a rank waiting
        for its step is alive, its cursor must not expire."""
        keepalive = max(0.25, min(self.config.consumer_ttl_s / 4, 10.0))
        since = time.monotonic()
        next_keepalive = since + keepalive
        while True:
            if request.ahead is not None and (request.stopped or not ray.is_initialized()):
                raise _ReadAheadStopped(f"read-ahead of step {request.step} stopped")  # see stop_background
            now = time.monotonic()
            if now >= deadline:
                raise ReplyTimeoutError(
                    f"service {self._where}: step {request.step}: the node reader did not "
                    f"answer a read call within {now - since:.0f}s"
                )
            ready, _ = ray.wait([ref], timeout=min(WAIT_POLL_S, deadline - now), fetch_local=False)
            if ready:
                return call(ref, self._where, timeout=max(1.0, deadline - time.monotonic()))
            now = time.monotonic()
            if now >= next_keepalive:
                next_keepalive = now + keepalive
                with self._lock:
                    for key in request.waiting:
                        self._note(key, request.step, now)
            self.flush()

    def invalidate(self, step: int, generation: int) -> None:
        """Shards of ``step`` were found lost: forget them here and tell the node reader (and so the coordinator)."""
        with self._lock:
            self._cache.drop(step, generation)
            reader = self._reader
        target = reader if reader is not None else self._coordinator
        ray.get(target.invalidate.remote(step, generation), timeout=30)

    # ------------------------------------------------------------------ cursor moves
    def advance(self, consumer: str, rank: int, world: int, step: int) -> None:
        """Record a cursor move; it goes with the next read call of any handle of this process, alone once no call
        went for ``keepalive_s``, or at once when the node reader asks for moves (a lease there waits)."""
        with self._lock:
            self._note((consumer, rank, world), step, time.monotonic())

    def _note(self, key: tuple[str, int, int], step: int, now: float) -> None:
        """(lock held) Keep ``step`` as the newest move of ``key`` (a rank's newer move replaces an older one even
        when its step is lower: only the coordinator keeps cursors monotonic, and a move it refused, such as a read
        past ``max_ahead``, must never shadow the rank's later ones), and make sure it is sent."""
        self._pending[key] = (step, now)
        self._arm(self.keepalive_s)
        reader = self._reader
        if reader is not None and self._listening is not reader:
            self._listening = reader
            # _listen takes only its own lock and starts a thread: no remote call under ours
            _listen(reader, self)

    def _arm(self, delay: float) -> None:
        """(lock held) A timer that sends what is still pending once nothing went for ``keepalive_s``."""
        if self._timer is None:
            self._timer = threading.Timer(delay, self._on_timer)
            self._timer.daemon = True
            self._timer.start()

    def _stop_listening(self, reader: Any) -> None:
        with self._lock:
            if self._listening is reader:
                self._listening = None

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
            if not self._pending:
                return
            rest = self._sent + self.keepalive_s - time.monotonic()
            if rest > 0.01:  # a read call carried moves meanwhile: look again when this one is due
                self._arm(rest)
                return
        self.flush()

    def _take_pending(self) -> list[CursorMove]:
        """The pending moves as cursor moves (lock held); they leave the pending set."""
        now = time.monotonic()
        moves = [
            CursorMove(c, r, w, s, round(max(0.0, now - when), 3)) for (c, r, w), (s, when) in self._pending.items()
        ]
        self._pending.clear()
        self._sent = now
        return moves

    def _requeue(self, moves: list[CursorMove]) -> None:
        """Moves a failed call carried go back to the pending set, unless the rank moved again since."""
        now = time.monotonic()
        with self._lock:
            for c, r, w, s, idle in moves:
                old = self._pending.get((c, r, w))
                if old is None or old[1] < now - idle:
                    self._pending[(c, r, w)] = (s, now - idle)

    def flush(self) -> None:
        """Send the pending moves now, alone (a keep-alive, or moves a waiting read may need)."""
        with self._lock:
            if not self._pending:
                return
            moves = self._take_pending()
            reader = self._reader
        if reader is None or not ray.is_initialized():  # Ray is down: see stop_background
            self._requeue(moves)
            return
        try:
            reader.advance.remote(moves)
        except Exception:  # noqa: BLE001 - the service is restarting: the moves go with the next read call
            self._requeue(moves)

    def quiesce(self, consumer: str | None = None) -> None:
        """Drop the unsent moves of ``consumer`` (this consumer is released), or all of them and the timer (the
        service is stopping)."""
        with self._lock:
            if consumer is not None:
                for key in [k for k in self._pending if k[0] == consumer]:
                    del self._pending[key]
            else:
                self._stopping.set()
            for request in self._requests:
                if request.ahead is not None and consumer in (None, request.ahead):
                    request.stopped = True
            timer = None
            if consumer is None or not self._pending:
                timer, self._timer = self._timer, None
                self._pending.clear()
        if timer is not None:
            timer.cancel()

    def join_background(self, timeout_s: float) -> None:
        """Wait for the read-aheads in flight to give up (after ``quiesce()``): within ``WAIT_POLL_S`` each, plus
        their cancellation."""
        with self._lock:
            threads = [t for t in self._ahead_threads if t is not threading.current_thread()]
        for thread in threads:
            thread.join(timeout_s)

    def release(self, consumer: str) -> None:
        with self._lock:
            reader = self._reader
        if reader is not None:
            reader.release.remote(consumer)


_PATHS: weakref.WeakValueDictionary[Any, ProcessReads] = weakref.WeakValueDictionary()
"""This process's shared node paths by coordinator actor (an ``ActorHandle`` hashes and compares by actor id)."""
_PATHS_LOCK = threading.Lock()


def process_reads(owner: Any) -> ProcessReads:
    """The node path of this process for ``owner``'s service (its coordinator actor), made on first use."""
    with _PATHS_LOCK:
        path = _PATHS.get(owner._coordinator)
        if path is None:
            path = _PATHS[owner._coordinator] = ProcessReads(
                owner._coordinator, owner._where, owner.config, owner.recipe.lanes
            )
        return path


class NodeReads:
    """The node path of one :class:`~zephon_ray.service.client.DataService` handle: a view, with the handle's
    consumer, of this process's :class:`ProcessReads` for the service. Handles of one process on one service share
    its lease cache, calls and unsent moves: W ranks' handles in one process cost the node reader one call per run
    (benchmarks/bench_service_load.py ``per_rank``; tests/test_node_reads.py)."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner
        self._path = process_reads(owner)

    def reader(self) -> Any:
        return self._path.reader()

    def warm(self, timeout_s: float = 120.0) -> None:
        self._path.warm(timeout_s)

    def forget_prefetched(self) -> None:
        """Nothing is prefetched on this path (a run of steps comes with each read call)."""

    def reset(self) -> None:
        """After a reconnect (a new coordinator incarnation: new node readers): the shared path starts over, for
        every handle of this process on the service."""
        path = process_reads(self._owner)
        if path is self._path:
            path.reset()
        self._path = path

    def prefetch(self, steps: list[int], rank: int, world: int, lo: int, hi: int) -> None:
        """Nothing to do: one read call brings a run of steps, and the node reader leases ahead."""

    def refs(
        self, step: int, rank: int, world: int, lo: int, hi: int, track: bool, timeout_s: float, deadline: float
    ) -> StepRefs:
        owner = self._owner
        held = self._path.held(owner.consumer, step, rank, world, lo, hi, track, timeout_s, deadline)
        return StepRefs(step, only_lanes(held.lanes, lo, hi), owner.recipe, owner._pad, held.generation)

    def advance(self, rank: int, world: int, step: int) -> None:
        self._path.advance(self._owner.consumer, rank, world, step)

    def flush(self) -> None:
        self._path.flush()

    def invalidate(self, step: int, generation: int) -> None:
        self._path.invalidate(step, generation)

    def quiesce(self, stopping: bool = False) -> None:
        """Drop this handle's consumer's unsent moves and stop its read-aheads (it is released); ``stopping``: the
        service is stopping, so every handle's in this process, waiting until they let go of the node reader."""
        if stopping:
            self._path.quiesce()
            self._path.join_background(5.0)
        else:
            self._path.quiesce(self._owner.consumer)

    def release(self, consumer: str) -> None:
        self._path.release(consumer)
