"""Timelines as Chrome/Perfetto trace JSON (open in ui.perfetto.dev or chrome://tracing).

One process per virtual worker, one thread per device; every instruction a
device carried out is a span with its start and end.
"""
import json
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

#: One trace event as Chrome's trace-event format has it (name, ph, pid, tid, ts, ...).
Event = dict[str, Any]


class TraceRecorder:
    """Collects spans from any thread and writes them as trace-event JSON."""

    def __init__(self, metadata: Mapping[str, Any] | None = None) -> None:
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._origin: float | None = None
        self.metadata = dict(metadata or {})

    def set_origin(self, t: float) -> float:
        """Time (seconds, same clock as the spans) shown as 0 in the trace; the first one set stays
        (several virtual workers may share one trace). Returns the origin in force."""
        if self._origin is None:
            self._origin = t
        return self._origin

    @property
    def origin(self) -> float | None:
        """The time shown as 0 (None before the first span or set_origin)."""
        return self._origin

    def add_events(self, events: Iterable[Mapping[str, Any]], origin: float) -> None:
        """Adds the events of another recorder whose origin was `origin` (same clock), shifted to
        this recorder's origin: several processes' traces in one."""
        shift = round((origin - self.set_origin(origin)) * 1e6, 1)
        for event in events:
            self._add(dict(event, ts=event["ts"] + shift) if "ts" in event else dict(event))

    def name_process(self, pid: int, name: str) -> None:
        self._add({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})

    def name_thread(self, pid: int, tid: int, name: str) -> None:
        self._add({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        self._add({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                   "args": {"sort_index": tid}})

    def span(self, pid: int, tid: int, name: str, start: float, end: float, category: str = "task",
             args: Mapping[str, Any] | None = None) -> None:
        origin = self._origin if self._origin is not None else start
        event: Event = {"name": name, "cat": category, "ph": "X", "pid": pid, "tid": tid,
                 "ts": round((start - origin) * 1e6, 1), "dur": round((end - start) * 1e6, 1)}
        if args:
            event["args"] = args
        self._add(event)

    def _add(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def to_dict(self) -> dict[str, Any]:
        return {"traceEvents": self.events(), "displayTimeUnit": "ms", "otherData": self.metadata}

    def write(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)
