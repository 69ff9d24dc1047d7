"""Whether and how much to draft here: what verifying N tokens costs on this machine (``cycle_cost``), the guard that
falls back to plain steps where drafting does not pay (``guard``), and device-synchronised clocks (``timing``).
"""
