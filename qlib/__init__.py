"""qlib: a small, readable engine for quantized Llama models stored as GGUF."""

__version__ = "0.1.0"
