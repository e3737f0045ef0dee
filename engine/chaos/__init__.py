"""Chaos runs: clients under load while a seeded schedule of faults hits a cluster of hosts."""
