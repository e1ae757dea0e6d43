"""Policies (one file per model family), LoRA, and tiny offline builders."""
