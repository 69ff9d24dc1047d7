"""The decoding cycle and its entry points: every option checked once (``config``), the one loop (``loop``), the one
verifier (``verification``), what a call reports (``stats``), and how ``generate`` reaches the loop (``integration``).
"""
