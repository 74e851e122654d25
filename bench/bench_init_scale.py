"""How detection margins move with the init scale: the floor and each seed injection's
deviation on TOY_KV4 at t=2 and t=4, for several weight stds and norm spreads.

    python bench/bench_init_scale.py

The committed threshold was measured at the default init (std 0.02, norm spread 0.1); at
other scales the floor moves too, so the column that matters is deviation / floor (the
margin a threshold 100x above that scale's floor would leave, times 100).
"""

from __future__ import annotations

import torch

from weight_sync_bench import TOY_KV4, Checker, sweep
from weight_sync_bench.check.mutations import SEED_MUTATIONS
from weight_sync_bench.model.config import Init, init_params

SCALES = [Init(0.02, 0.1), Init(0.005, 0.1), Init(0.05, 0.1), Init(0.2, 0.1), Init(1.0, 0.1),
          Init(0.02, 0.01), Init(0.02, 0.3)]


def main() -> None:
    torch.set_num_threads(1)
    names = [m.name for m in SEED_MUTATIONS]
    print(f"{'std':>6} {'norm':>5} {'t':>2} {'floor':>9}  " + "  ".join(f"{n:>16}" for n in names))
    print(f"{'':>25}  " + "  ".join(f"{'dev (dev/floor)':>16}" for _ in names))
    for init in SCALES:
        checker = Checker(TOY_KV4, params=init_params(TOY_KV4, 0, init), threshold=1.0)
        for t in (2, 4):
            floor = checker.declared_error(t)
            cells = []
            for mutation in SEED_MUTATIONS:
                (v,) = sweep(TOY_KV4, pairs=[(1, t)], mutation=mutation, checker=checker)
                cells.append(f"{v.max_abs_error:7.3g} ({v.max_abs_error / floor:6.0f})")
            print(f"{init.std:6.3f} {init.norm_spread:5.2f} {t:>2} {floor:9.3g}  "
                  + "  ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
