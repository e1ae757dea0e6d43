"""paco_ds: PaCo-GRPO and PaCo-Reward on DeepSpeed."""
__version__ = "0.1.0"
