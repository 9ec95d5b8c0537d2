"""Triton kernels for ``qlib.quants.gpu`` (imported only when a CUDA path runs), benchmark."""
