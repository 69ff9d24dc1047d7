"""Training a drafter on a target's own answers: data (``data``, ``code_prompts``), a drafter set up from the target
(``setup``), training blocks (``blocks``) and their labels (``labels``), the trainer (``trainer``) and resumable
checkpoints (``checkpoint``).
"""


from .._moved import wing_getattr

__getattr__ = wing_getattr("training", ("training.trainer",))  # 0.1's dflash2_hf.training module
