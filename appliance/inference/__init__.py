"""The llama.cpp adapter: models.lock, the inference pool, tier routing."""
