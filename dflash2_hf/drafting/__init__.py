"""What the drafter proposes each cycle: one block drafted in one forward (``block``), its top-K lattice and pair scores
(``lattice``), the token tree verified (``tree``), and the branch copied from the context (``lookup``), as the call's
options ask (``options``).
"""

from .._moved import wing_getattr

__getattr__ = wing_getattr("drafting", ("drafting.block", "drafting.options"))  # 0.1's dflash2_hf.drafting module
