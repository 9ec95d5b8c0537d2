"""The llama forward pass from a GGUF file, three engines behind one interface (``engine``):
``faithful`` (candle 0.11.0's ``quantized_llama`` as it is), ``fast_cpu`` and ``fast_cuda``;
what they share: ``config`` (hyper-parameters and tensor checks), ``errors``, ``checks``
(forward-input checks), ``fused`` (the projections the fast engines stack)."""
