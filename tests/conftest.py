"""One torch thread per process, and the fuzz profile: ``$WSB_PROFILE``, else ``wsb-test``
(never Hypothesis's built-in ``ci``, which ``CI=true`` would otherwise load)."""

import torch
from hypothesis import settings

from weight_sync_bench.fuzz.runner import profile_name  # registers the wsb-* profiles

torch.set_num_threads(1)
settings.load_profile(profile_name())
