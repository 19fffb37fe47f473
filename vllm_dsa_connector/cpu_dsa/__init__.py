"""DSA (DeepSeek Sparse Attention) on vLLM's CPU platform: a torch reference backend.

vLLM 0.32 refuses sparse attention on CPU. This package supplies what the GPU path has, with the
same cache layouts, so a KV connector sees on CPU exactly the bytes it would see on GPU:

- ``quant``: fp8 e4m3 quantization and the block-split indexer cache layout
  (``[block_size x 128 fp8][block_size x fp32 scale]`` per page), logits as DeepGEMM computes them.
- ``backend``: ``CpuDSAIndexerBackend`` (indexer K cache) and ``CpuSparseMLABackend`` (sparse MLA
  over the top-k latent rows).
- ``indexer_op``: the indexer (K insert, logits from the cache, top-k per token) as a torch op.
- ``registration``: the guarded runtime patches that route DSA models to these backends on CPU.
- ``tiny_model``: a tiny random GLM-MoE-DSA model and a transformers reference for it.

Modules that import vLLM are not imported here; import them explicitly.
"""
