"""Shared test settings: one thread per process (2-core CI machines), float64 where asked."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
