"""Data parallelism with ZeRO stages 0-3: flat fp32 shards and AdamW (``flat_shards``), the engine
(``zero_engine``), ZeRO-3's parameter lifetime (``zero3_lifetime``), mixed precision and loss
scaling (``precision``), gradients of weights tied across pipeline stages (``tied_weights``), and
optimizer/parameter offload to host memory or NVMe (``offload_engine``)."""
