"""Which peer a distributed run lost. Every process records the step it has finished in the process group's
store (``vitrain/heartbeat/<rank>``: step and time); when a collective fails because a peer is gone (the
connection closed) or silent past ``parallel.timeout_s`` (the collective timed out), the failure is
replaced by :class:`PeerLost`, whose one line names the rank that stopped, the step it last finished and
how long ago, and what to do: instead of a gloo or NCCL message naming no rank, or a job that waits
forever.
"""

from __future__ import annotations

import datetime
import re
import time

import torch.distributed as dist

KEY = "vitrain/heartbeat/{rank}"
LOST = re.compile(r"timed out|timeout|connection closed|connection reset|broken pipe|peer", re.IGNORECASE)
"""What the collectives say when a peer died or hangs (gloo and NCCL wordings)."""
READ_TIMEOUT_S = 5.0


class PeerLost(RuntimeError):
    """A peer of a distributed run died or stopped answering; the message names it."""


class Heartbeat:
    """This process's finished steps in the store, and the reading of every rank's after a failure."""

    def __init__(self, rank: int, size: int, timeout_s: float):
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.store = dist.distributed_c10d._get_default_store() if size > 1 and dist.is_initialized() else None

    def beat(self, step: int) -> None:
        if self.store is not None:
            self.store.set(KEY.format(rank=self.rank), f"{step} {time.time():.3f}")

    def last_steps(self) -> dict[int, tuple[int, float] | None]:
        """Per rank, (last finished step, seconds since), or None where the rank never recorded one."""
        self.store.set_timeout(datetime.timedelta(seconds=READ_TIMEOUT_S))
        now, found = time.time(), {}
        for rank in range(self.size):
            key = KEY.format(rank=rank)
            try:
                step, stamp = self.store.get(key).decode().split() if self.store.check([key]) else (None, None)
            except (RuntimeError, ValueError):
                step, stamp = None, None
            found[rank] = None if step is None else (int(step), now - float(stamp))
        return found

    def explain(self, error: BaseException) -> BaseException:
        """:class:`PeerLost` naming the lost rank(s) for a collective's failure that says a peer is gone or
        silent; ``error`` itself for any other failure, or where there is no store to read."""
        if self.store is None or not LOST.search(str(error)):
            return error
        try:
            steps = self.last_steps()
        except RuntimeError:  # the store went with its host: nothing to read
            return error
        return PeerLost(describe_lost(steps, self.rank, self.timeout_s, str(error).strip().splitlines()[0][:200]))


def describe_lost(steps: dict[int, tuple[int, float] | None], me: int, timeout_s: float, cause: str) -> str:
    """The one-line message: the ranks furthest behind (or never heard from), where this rank is, the fix."""
    others = {rank: value for rank, value in steps.items() if rank != me}
    silent = [rank for rank, value in others.items() if value is None]
    if silent:
        lost = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} never finished a step"
    else:
        behind = min(value[0] for value in others.values())
        ranks = [rank for rank, value in others.items() if value[0] == behind]
        age = max(others[rank][1] for rank in ranks)
        lost = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} last finished step {behind}, {age:.0f} s ago"
    mine = steps.get(me)
    where = f"rank {me} is past step {mine[0]}" if mine else f"rank {me} had not finished a step"
    return (
        f"a peer died or hangs: {lost}; {where} and waited past parallel.timeout_s={timeout_s:g} ({cause}); "
        "see that rank's log, and raise parallel.timeout_s if its steps are legitimately that slow"
    )
