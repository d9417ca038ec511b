"""The sampling flags shared by the verbs that sample (generate, traces, accuracy evaluation), declared once and
defaulting to the one `REASONING_SAMPLING` of the runtime (greedy decoding: --temperature 0)."""

from __future__ import annotations

import argparse

from foresight.runtime.sampling import REASONING_SAMPLING


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = REASONING_SAMPLING
    parser.add_argument(
        "--temperature", type=float, default=defaults.temperature, help="sampling temperature; 0 is greedy"
    )
    parser.add_argument(
        "--top-k", type=int, default=defaults.top_k, help="sample from the k most likely tokens; 0 disables"
    )
    parser.add_argument("--top-p", type=float, default=defaults.top_p, help="nucleus sampling mass; 1 disables")
