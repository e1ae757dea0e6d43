"""Rewards: one file per reward, a name registry, aggregation, and a runner that scores async."""
