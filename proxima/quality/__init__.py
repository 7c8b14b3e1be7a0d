"""Quality evaluation: datasets, the harness, baselines and the damage model (SmolLM2, offline)."""
