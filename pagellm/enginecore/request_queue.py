"""The waiting queue, per scheduling policy.

- FCFS: arrival order; a preempted request goes back to the front.
- Priority: lowest `priority` first, ties by arrival time (then by arrival here); a
  preempted request simply goes back in by its key.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from pagellm.enginecore.request import Request
from pagellm.protocol.engine_args import SCHEDULING_POLICIES


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def readd(self, request: Request) -> None:
        """Return a preempted request."""
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def readd(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()
        self._removed: set[int] = set()  # ids of requests removed but still in the heap

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time,
                                    next(self._order), request))

    readd = add

    def peek(self) -> Request:
        self._drop_removed()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_removed()
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        """Lazy: the entry is skipped when it reaches the top."""
        self._removed.add(id(request))

    def _drop_removed(self) -> None:
        while self._heap and id(self._heap[0][3]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[3]))

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap) if id(entry[3]) not in self._removed)


def sort_key(request: Request) -> tuple[int, float]:
    """Priority order of running requests: the last one is preempted first."""
    return request.priority, request.arrival_time


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
