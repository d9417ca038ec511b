"""Train an evictor for a model and compare it with the heuristics, from Python (docs/training.md).

python examples/train_evictor.py                      # the embedded default model, a short recipe
python examples/train_evictor.py --model Qwen/Qwen3-4B -B 1024 -L 256 --config configs/qwen3-4b.yaml
"""

import argparse
from pathlib import Path

import foresight
import trainers
from foresight.eval.results import evaluation_table
from foresight.eval.specs import policy_specs
from trainers import TraceRecipe

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="default")
parser.add_argument("-B", "--budget", type=int, default=128)
parser.add_argument("-L", "--interval", type=int, default=32)
parser.add_argument("--config", default="configs/default.yaml")
parser.add_argument("--prompts", default="reasoning-gym:gsm_symbolic")
parser.add_argument("--heldout-prompts", default="reasoning-gym:chain_sum")
parser.add_argument("--num", type=int, default=24, help="traces to train on (a real run: thousands)")
parser.add_argument("--max-new-tokens", type=int, default=512)
parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
parser.add_argument("--out", type=Path, default=Path("runs/example"))
args = parser.parse_args()
B, L, out = args.budget, args.interval, args.out

# 1. Traces of the frozen model: one folder to train on, one of other task families to judge on.
for folder, prompts, num, seed in (
    (out / "traces", args.prompts, args.num, 0),
    (out / "heldout", args.heldout_prompts, 8, 1),
):
    recipe = TraceRecipe(prompts, num=num, max_new_tokens=args.max_new_tokens, min_tokens=B + 2 * L, seed=seed)
    trainers.make_traces(folder, recipe, model=args.model)
    # 2. Golden labels: which entries each eviction step's future attention needs.
    trainers.make_labels(folder, B, L)

# 3. The supervised fit (4. `trainers.rl(...)` would refine it; the project ships no reinforced scorer yet).
scorer = trainers.fit(args.config, out / "fit", traces=out / "traces", model=args.model, budget=B, interval=L,
                      ensemble=1, overrides=args.overrides)  # fmt: skip

# 5. The learned scorer against golden and the heuristics on the held-out families.
model, _ = foresight.load_model(args.model)
specs, _ = policy_specs("full,golden,snapkv,tova,h2o", [f"mine={scorer}"])
traces = list(foresight.TraceStore(out / "heldout"))
result = foresight.evaluate(model, traces, specs, [B], L, labels_root=out / "heldout")
print(evaluation_table(result.rows))
