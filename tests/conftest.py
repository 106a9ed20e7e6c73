import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def sample_plan_dict():
    """A valid plan.json body for a 4-block model on 4 devices (dp 2 x pp 2)."""
    return {
        "schema_version": 1,
        "model": {"spec": "gpt", "params": 1000, "layers": 4, "flops_per_step": 1.0e9,
                  "sizes": {"layers": 4}, "layer_names": ["embed", "blocks.0", "blocks.1", "blocks.2",
                                                           "blocks.3", "head"]},
        "hardware": {"name": "cpu", "gpus": 4, "gpus_per_node": 4},
        "global_batch": 8, "seq_len": 16, "dtype": "fp32",
        "dp": 2, "tp": 1, "pp": 2, "zero_stage": 1,
        "micro_batch_size": 2, "num_micro_batches": 2,
        "stages": [[0, 2], [3, 5]],
        "checkpoint_layers": [1],
        "predicted": {"step_time_s": 0.5, "peak_memory_bytes": 100, "tflops_per_device": 0.1, "mfu": 0.2,
                      "comm_bytes_per_device": 10.0, "bubble_fraction": 0.33,
                      "memory": {"params": 10, "grads": 10, "optimizer": 30, "activations": 50, "total": 100},
                      "time": {"compute": 0.3, "recompute": 0.05, "tp_comm": 0.0, "pp_bubble": 0.1,
                               "dp_comm": 0.03, "optimizer": 0.02}},
        "solver": {"name": "pulp-cbc", "seconds": 0.1, "status": "Optimal", "candidates": 12},
        "alternatives": [{"dp": 4, "tp": 1, "pp": 1, "zero_stage": 0, "micro_batch_size": 1,
                          "step_time_s": 0.6, "reason": "slower: more DP all-reduce"}],
    }
