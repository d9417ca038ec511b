"""DeviceClock on the host: each region's seconds reach its receiver when it stops, added to a counter."""

from __future__ import annotations

import time
from types import SimpleNamespace

from foresight.runtime.device_clock import DeviceClock, adding_to


def test_host_regions_hand_their_seconds_over_at_once_and_add_up():
    clock, counters = DeviceClock("cpu"), SimpleNamespace(seconds=1.0)
    assert not clock.events
    for pause in (0.02, 0.03):
        start = clock.start()
        time.sleep(pause)
        clock.stop(start, adding_to(counters, "seconds"))
    assert 1.05 <= counters.seconds < 2.0
    clock.settle()  # nothing pending on the host
    assert counters.seconds < 2.0
