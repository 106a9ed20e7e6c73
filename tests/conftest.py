import os
import shutil
import sys
import tempfile

import pytest
from hypothesis import settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("OMP_NUM_THREADS", "1")

# One layer-table cache per test session (planner.frontend.cache): tests never read or write the
# user's ~/.cache, and a model planned by several tests is traced once. Set in the environment, so
# the `planner` subprocesses tests spawn share it. `PLANNER_CACHE=off make test` runs every trace.
_CACHE_DIR = tempfile.mkdtemp(prefix="planner-test-cache-")
os.environ["PLANNER_CACHE_DIR"] = _CACHE_DIR


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


# CI (``.ci/run``) replays the same examples every run, so a landing is decided by the code and not
# by the draw; local runs keep exploring new examples, which is where counterexamples come from.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def sample_plan_dict():
    """A valid plan.json body for a 4-block model on 4 devices (dp 2 x pp 2)."""
    from tests.helpers import make_plan

    plan = make_plan("gpt", {"layers": 4}, dp=2, pp=2, zero=1, mbs=2, m=2, checkpoint=(1,), stages=[[0, 2], [3, 5]])
    d = plan.to_dict()
    d["model"]["layer_names"] = ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    d["alternatives"] = [
        {
            "dp": 4,
            "tp": 1,
            "pp": 1,
            "zero_stage": 0,
            "micro_batch_size": 1,
            "step_time_s": 0.6,
            "reason": "slower: more DP all-reduce",
        }
    ]
    return d
