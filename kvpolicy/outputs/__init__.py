"""Outputs of a decision: the Recommendation, its rendering, vLLM's flags and launch, calibration recipes."""
