"""Measurement with torch: the real training step, tensor by tensor, that the
estimator is checked against (needs torch at import time)."""
