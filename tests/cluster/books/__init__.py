"""Tests of the cluster member's books (`engine.cluster.books`)."""
