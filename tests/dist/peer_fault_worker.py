"""``vitrain`` whose rank 1 fails at a given training step, for test_multinode.py (pytest does not collect
this file):

    torchrun ... peer_fault_worker.py kill STEP -- <vitrain arguments>   # SIGKILL, first attempt only
    torchrun ... peer_fault_worker.py hang STEP -- <vitrain arguments>   # sleeps, never returns

In ``hang`` mode rank 0 also spends :data:`SLOW_SETUP_S` alone before the first step (as it does measuring
the ``auto`` choices): longer than the test's ``parallel.timeout_s``, which must count only from the steps.

``kill`` is a crash with no clean-up: torchrun (``--max-restarts``) stops the other worker and starts the
group again (``TORCHELASTIC_RESTART_COUNT`` 1), which resumes from the newest complete checkpoint
(``--resume auto``). ``hang`` leaves its peers waiting in the next collective until ``parallel.timeout_s``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

SLOW_SETUP_S = 7.0


def main() -> int:
    mode, fault_step, separator, *args = sys.argv[1:]
    assert mode in ("kill", "hang") and separator == "--", "usage: peer_fault_worker.py kill|hang STEP -- <args>"
    from vitrain.cli import main as vitrain_main
    from vitrain.train.step import TrainStep

    original = TrainStep.__call__
    steps = 0

    def step_then_maybe_fail(self, *step_args, **kwargs):
        nonlocal steps
        steps += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if steps == int(fault_step) and os.environ.get("RANK") == "1":
            if mode == "kill" and first_attempt:
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "hang":  # torchrun's SIGTERM, once the peers gave up, ends it at once (not vitrain's handler)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                time.sleep(3600)
        return original(self, *step_args, **kwargs)

    TrainStep.__call__ = step_then_maybe_fail
    if mode == "hang" and os.environ.get("RANK") == "0":
        import vitrain.train.loop as loop

        probe = loop.run_peaks

        def slow_probe(*probe_args):
            time.sleep(SLOW_SETUP_S)
            return probe(*probe_args)

        loop.run_peaks = slow_probe
    return vitrain_main(args)


if __name__ == "__main__":
    sys.exit(main())
