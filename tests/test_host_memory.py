"""`trainers.process`: freed tensors' pages stay resident for the next step, unless the user tuned malloc.

Each case runs in a fresh interpreter: the setting lasts for the process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

FREE_A_TENSOR = """
import json, sys
import torch
from trainers.process import keep_freed_memory

def resident_mib():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) / 1024

kept = keep_freed_memory() if sys.argv[1] == "keep" else False
tensor = torch.ones(64 * 2**20 // 4)  # 64 MiB, every page touched
held = resident_mib()
del tensor
print(json.dumps({"kept": kept, "released_mib": held - resident_mib()}))
"""


def free_a_tensor(mode: str, **environment: str) -> dict:
    env = {**os.environ, **environment}
    done = subprocess.run(
        [sys.executable, "-c", FREE_A_TENSOR, mode], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_memory_stays_resident_once_kept():
    assert free_a_tensor("keep") == {"kept": True, "released_mib": pytest.approx(0, abs=8)}


def test_glibc_gives_a_freed_tensor_back_by_default():
    figures = free_a_tensor("default")
    assert not figures["kept"] and figures["released_mib"] > 56


@pytest.mark.parametrize(
    "variable, value", [("MALLOC_MMAP_MAX_", "65536"), ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")]
)
def test_a_user_setting_of_malloc_is_left_alone(variable, value):
    figures = free_a_tensor("keep", **{variable: value})
    assert not figures["kept"] and figures["released_mib"] > 56
