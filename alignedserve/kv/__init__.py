"""KV-cache bookkeeping (pure Python, no torch): tiers, allocations, moves, placement, op log."""
