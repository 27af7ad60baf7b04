"""A thread per stage for what a stage sends to the other workers, in the order it sends it.

Pure Python. A stage hands its wave's push (WSP, HetPipe §5) or its all-reduce (Pipe-SGD) to its
lane and goes on with its next task, as the simulator has it (the transfer is the servers' time,
not the stage's). One stage's sends stay in order; a send that needs an earlier one's answer
waits for its future.
"""
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

_Result = TypeVar("_Result")


class StageLanes:
    """One lane (a thread) per stage of virtual worker `worker`, made when the stage first sends;
    `name` prefixes the threads' names."""

    def __init__(self, name: str, worker: int) -> None:
        self.name = name
        self.worker = worker
        self._lock = threading.Lock()
        self._pools: dict[int, ThreadPoolExecutor] = {}  # stage -> its thread
        self._sent: dict[Future[Any], str] = {}  # future -> what it sends, until it ends well or settle() takes it

    def submit(self, stage: int, what: str, fn: Callable[..., _Result], *args: Any) -> Future[_Result]:
        """Runs fn(*args) on `stage`'s lane after everything the stage sent before; returns its
        future. `what` names the send in an error."""
        with self._lock:
            pool = self._pools.get(stage)
            if pool is None:
                pool = self._pools[stage] = ThreadPoolExecutor(
                    1, thread_name_prefix=f"{self.name}-w{self.worker}-s{stage}")
            future = pool.submit(fn, *args)
            self._sent[future] = f"stage {stage}'s {what}"
        future.add_done_callback(self._ended)
        return future

    def _ended(self, future: Future[Any]) -> None:
        if future.exception() is None:
            with self._lock:
                self._sent.pop(future, None)

    def settle(self, timeout_s: float) -> None:
        """Waits until every send has ended, then ends the lanes. Raises the first send's error,
        or a TimeoutError naming the sends still going after `timeout_s` seconds (their lanes
        are left to end by themselves)."""
        with self._lock:
            sent, self._sent = self._sent, {}
            pools, self._pools = self._pools, {}
        done, going = wait(sent, timeout=timeout_s, return_when=FIRST_EXCEPTION)
        for future in done:
            error = future.exception()
            if error is not None:
                raise error
        if going:
            names = ", ".join(sorted(sent[f] for f in going))
            raise TimeoutError(f"{names} of virtual worker {self.worker} did not end within {timeout_s:g} s")
        for pool in pools.values():
            pool.shutdown(wait=False)
