"""kvpress's decoding-time compression as a decoder of `foresight bench serve`, for a side-by-side run.

kvpress is not a dependency of this project and pins another transformers, so it runs in its own
environment (scripts/crosscheck.sh makes .venv-kvpress). `KvpressDecoder` starts this module there
as a worker (`python -m foresight.bench.kvpress_worker CONFIG`) that loads the same model, wraps it in
`DecodingPress(base_press, compression_interval=L, target_size=B)` and answers run requests, one
JSON line in and one out, with the same `foresight.bench.watched_run` measurement as our engine: the same
prompt, greedy decoding with EOS ignored (`model.generate`, min_new_tokens = max_new_tokens), the
cache's bytes read after every forward, the run stopped past the cap.

Every L decoding steps DecodingPress scores the whole cache with the base press and keeps B entries,
so a sequence holds at most B + L of them, as under our cadence (which keeps the newest L entries out
of the scoring; kvpress scores them too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from foresight.bench.watched_run import RunResult

# Our policy name -> (kvpress press, keyword arguments that give it our rule's settings)
PRESSES: dict[str, tuple[str, dict[str, Any]]] = {
    "snapkv": ("SnapKVPress", {"window_size": 8, "kernel_size": 7}),  # ours: α = 8 queries, kernel 7
    "knorm": ("KnormPress", {}),
    "streaming": ("StreamingLLMPress", {"n_sink": 4}),
}


class KvpressDecoder:
    """The main process's handle on a kvpress worker running in another Python environment."""

    def __init__(
        self,
        python: str,
        policy: str,
        budget: int,
        interval: int,
        model: str,
        device: str,
        dtype: str,
        threads: int,
        prompt: Sequence[int],
    ):
        if policy not in PRESSES:
            raise ValueError(f"no kvpress counterpart for policy {policy!r}; choose from: {', '.join(PRESSES)}")
        if not Path(python).is_file():
            raise ValueError(f"kvpress python {python!r} is not a file; make .venv-kvpress with scripts/crosscheck.sh")
        self.python = python
        self.name = f"kvpress {PRESSES[policy][0]}"
        self.evicts = True
        self.prompt_length = len(prompt)
        self.budget, self.interval = budget, interval
        config = dict(
            policy=policy,
            budget=budget,
            interval=interval,
            model=model,
            device=device,
            dtype=dtype,
            threads=threads,
            prompt=list(prompt),
        )
        self.process = subprocess.Popen(
            [python, "-m", __name__, json.dumps(config)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._call({"ready": True})

    def held_entries(self, new_tokens: int) -> int:
        # DecodingPress leaves the prefill alone and compresses after every L decoding steps.
        return min(self.prompt_length + new_tokens - 1, max(self.prompt_length, self.budget) + self.interval)

    def run(self, batch: int, new_tokens: int, cap_bytes: int | None) -> RunResult:

        return RunResult(**self._call({"batch": batch, "new_tokens": new_tokens, "cap_bytes": cap_bytes}))

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise ValueError(
                f"the kvpress worker ({self.python}) stopped with exit status {self.process.wait()}; see its messages above"
            )
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def _serve(config: dict[str, Any]) -> None:
    """The worker: answer run requests from stdin until it closes. Its stdout carries the answers
    only; anything else the libraries print goes to stderr."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # also what C code writes to fd 1
    sys.stdout = sys.stderr
    import kvpress
    import torch

    from foresight.bench.watched_run import timed_run
    from foresight.models import DTYPES, load_model

    torch.set_num_threads(config["threads"])
    model, _ = load_model(config["model"], device=config["device"], dtype=DTYPES[config["dtype"]])
    model.set_attn_implementation("sdpa")
    press_name, options = PRESSES[config["policy"]]
    press = kvpress.DecodingPress(
        base_press=getattr(kvpress, press_name)(**options),
        compression_interval=config["interval"],
        target_size=config["budget"],
        hidden_states_buffer_size=max(config["interval"], options.get("window_size", 0)),
    )
    name = f"kvpress {press_name}"
    prompt = torch.tensor([config["prompt"]], device=model.device)
    for line in sys.stdin:
        request = json.loads(line)
        if "ready" in request:
            print(json.dumps({"ready": True}), file=answers, flush=True)
            continue
        batch, new_tokens = request["batch"], request["new_tokens"]

        def generate() -> None:
            from transformers import DynamicCache

            with press(model):
                model.generate(
                    prompt.expand(batch, -1),
                    attention_mask=torch.ones_like(prompt).expand(batch, -1),
                    past_key_values=DynamicCache(),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )

        result = timed_run(name, model, batch, new_tokens, request["cap_bytes"], generate)
        print(json.dumps(result.as_json()), file=answers, flush=True)


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
