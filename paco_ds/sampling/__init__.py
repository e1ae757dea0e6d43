"""Schedules, the SDE step with log-probs and the rollout loop."""
