"""Stored responses (`store: true`, the Responses API's default): each
response with its whole conversation (the input items it was generated
from, its predecessors' included, then its output items), in memory, so
that `previous_response_id` can continue it and `GET /v1/responses/{id}`
return it.

Bounded by count and by bytes (the JSON size of each response and of its
whole conversation: a conversation shares its items with its predecessor's
in memory, so the real footprint is at most the sum counted). When a new
response goes over either bound the oldest are evicted; a response larger
than the byte bound alone is not kept. The store lives on the event loop's
thread only (no locking).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass


def json_size(obj) -> int:
    return len(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode())


@dataclass
class StoredResponse:
    response: dict            # the response object, as it was returned
    conversation: list[dict]  # input items (predecessors' first), then this response's output items
    n_input: int              # conversation[:n_input] were its input
    conversation_bytes: int
    nbytes: int

    @property
    def input_items(self) -> list[dict]:
        return self.conversation[:self.n_input]


class ResponseStore:
    DEFAULT_MAX_COUNT = 1000
    DEFAULT_MAX_BYTES = 256 << 20

    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_count < 1 or max_bytes < 1:
            raise ValueError("max_count and max_bytes must be >= 1")
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, rid: str) -> bool:
        return rid in self._items

    def get(self, rid: str) -> StoredResponse | None:
        return self._items.get(rid)

    def put(self, response: dict, previous: StoredResponse | None, new_input: list[dict],
            output: list[dict]) -> bool:
        """Keeps `response` (its id is the key) with `previous`'s conversation,
        then `new_input` and `output`. False when it alone is over the byte bound."""
        head = previous.conversation if previous is not None else []
        own = new_input + output
        conv_bytes = (previous.conversation_bytes if previous is not None else 0) + sum(json_size(x) for x in own)
        entry = StoredResponse(response, head + own, len(head) + len(new_input), conv_bytes,
                               conv_bytes + json_size(response))
        if entry.nbytes > self.max_bytes:
            return False
        self.delete(response["id"])
        self._items[response["id"]] = entry
        self.nbytes += entry.nbytes
        while len(self._items) > self.max_count or self.nbytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evicted += 1
        return True

    def delete(self, rid: str) -> bool:
        old = self._items.pop(rid, None)
        if old is None:
            return False
        self.nbytes -= old.nbytes
        return True
