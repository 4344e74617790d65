"""Silence megatron-core's import-time notices about optional CUDA packages (Transformer Engine,
Apex) and deprecated defaults, which say nothing actionable on a CPU run."""
import warnings


def quiet_library_warnings() -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", message=r".*requires_grad=True to a scalar.*")
    warnings.filterwarnings("ignore", message=r".*non-contiguous.*")
    # megatron's DDP reads .grad of its buffer views, and calls the collectives under their
    # pre-2.13 names; neither is ours to change.
    warnings.filterwarnings("ignore", message=r".*\.grad attribute of a Tensor that is not a leaf.*")
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.distributed\..* is deprecated.*")
