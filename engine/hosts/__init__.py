"""Several hosts on one Linux machine: network namespaces on a bridge, etcd and node processes on them."""
