"""Measuring drafters and decoding: acceptance (``evaluation``), speed against plain decoding and peers
(``benchmark``, ``reference_peer``, ``llama_cpp_peer``), the statistics of exact sampling (``exactness``), and plots.
"""
