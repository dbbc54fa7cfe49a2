"""Turning probabilities into actions: calibration files, fitting and applying them, debiasing, trained heads, abstention and answer sets."""
