"""The CUDA side of the quantized matmul: ``layout`` (GGUF blocks repacked into planes),
``kernels`` and ``fused`` (Triton; imported only when a CUDA path runs), ``matmul`` (the path
choice and dispatch), ``bench``."""
