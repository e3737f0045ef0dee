"""Prefill scheduling through a real node: where prompts go, and how long ones run in chunks."""
