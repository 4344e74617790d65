"""Silence megatron-core's import-time notices about optional CUDA packages (Transformer Engine,
Apex) and deprecated defaults, which say nothing actionable on a CPU run."""
import warnings


def quiet_library_warnings() -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", message=r".*requires_grad=True to a scalar.*")
    warnings.filterwarnings("ignore", message=r".*non-contiguous.*")
