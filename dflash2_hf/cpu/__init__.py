"""CPU-only speed and bf16 exactness: packed oneDNN linears and what this CPU has (``kernels``), the float64
attention (``exact_attention``) and grouped-query attention without copied keys (``grouped_attention``). Nothing here
runs for a target on another device.
"""
