"""A cluster of nodes on etcd (docs/cluster.md)."""
