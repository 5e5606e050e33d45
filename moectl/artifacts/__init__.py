"""Readers of the artifacts the calibration pipeline writes (no torch): what applying them needs."""
