import os
import sys

import pytest
from hypothesis import settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("OMP_NUM_THREADS", "1")

# CI (``.ci/run``) replays the same examples every run, so a landing is decided by the code and not
# by the draw; local runs keep exploring new examples, which is where counterexamples come from.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def sample_plan_dict():
    """A valid plan.json body for a 4-block model on 4 devices (dp 2 x pp 2)."""
    from tests.helpers import make_plan

    plan = make_plan("gpt", {"layers": 4}, dp=2, pp=2, zero=1, mbs=2, m=2, checkpoint=(1,),
                     stages=[[0, 2], [3, 5]])
    d = plan.to_dict()
    d["model"]["layer_names"] = ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    d["alternatives"] = [{"dp": 4, "tp": 1, "pp": 1, "zero_stage": 0, "micro_batch_size": 1,
                          "step_time_s": 0.6, "reason": "slower: more DP all-reduce"}]
    return d
