"""The decoding cycle and its entry points: the generation settings checked once (``config``), the verification widths exact here (``exact_widths``), the one loop (``loop``), the one
verifier (``verification``), what a call reports (``stats``), and how ``generate`` reaches the loop (``integration``).
"""
