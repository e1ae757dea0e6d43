"""Reward servers: the vLLM command builder, the built-in transformers engine, the gateway, and
the manager that starts, checks and stops them (`launch/serve_reward.py`)."""
