"""``ByteCounter``: the bytes a communicator really moved for this rank, per tensor and per step."""

from __future__ import annotations

from collections import defaultdict


class ByteCounter:
    """Bytes a communicator really moved for this rank: per tensor name and per step.

    ``sent`` counts what this rank puts on the wire, ``received`` what it gets back from
    the others (its own contribution excluded). ``end_step`` closes a step."""

    def __init__(self):
        self.sent = defaultdict(int)
        self.received = defaultdict(int)
        self.steps: list[dict] = []

    def add(self, name: str, sent: int = 0, received: int = 0) -> None:
        self.sent[name] += int(sent)
        self.received[name] += int(received)

    def end_step(self) -> dict:
        summary = {"sent": sum(self.sent.values()), "received": sum(self.received.values()),
                   "per_tensor": {k: (self.sent[k], self.received[k]) for k in self.sent}}
        self.steps.append(summary)
        self.sent.clear()
        self.received.clear()
        return summary

    def reset(self) -> None:
        self.sent.clear()
        self.received.clear()
        self.steps.clear()
