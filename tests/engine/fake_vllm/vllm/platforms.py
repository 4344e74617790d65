"""``vllm.platforms.current_platform`` of the fake vLLM: CUDA unless QUATRO_FAKE_VLLM_PLATFORM=cpu."""
import os


class CudaPlatform:
    def is_cuda_alike(self) -> bool:
        return True


class CpuPlatform:
    def is_cuda_alike(self) -> bool:
        return False


current_platform = CpuPlatform() if os.environ.get("QUATRO_FAKE_VLLM_PLATFORM") == "cpu" else CudaPlatform()
