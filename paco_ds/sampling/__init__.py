"""Schedules, the SDE step with log-probs, the rollout loop, and grid/panel helpers."""
