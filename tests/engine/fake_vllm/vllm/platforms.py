"""``vllm.platforms.current_platform`` of the fake vLLM: CUDA unless QUATRO_FAKE_VLLM_PLATFORM names
another (``cpu``, or ``tpu``: a platform the backend refuses)."""
import os


class CudaPlatform:
    def is_cuda_alike(self) -> bool:
        return True

    def is_cpu(self) -> bool:
        return False

    def is_sleep_mode_available(self) -> bool:
        return True


class CpuPlatform:
    def is_cuda_alike(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return True

    def is_sleep_mode_available(self) -> bool:
        return False


class TpuPlatform(CpuPlatform):
    def is_cpu(self) -> bool:
        return False


current_platform = {"cpu": CpuPlatform, "tpu": TpuPlatform}.get(os.environ.get("QUATRO_FAKE_VLLM_PLATFORM"),
                                                                CudaPlatform)()
