import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # the workers share the machine's cores: one intra-op thread each (and in the processes a
    # distributed test spawns), not every worker as many threads as there are cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
