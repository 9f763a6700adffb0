"""Energy sources (NVML, RAPL, estimate, replay) and attribution of energy to calls."""
