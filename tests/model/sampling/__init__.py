"""Sampling: the host and device samplers, penalties and bias, grammar masks."""
