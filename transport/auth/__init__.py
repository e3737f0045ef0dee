"""Who may open a link: the cluster secret's challenge–response, per-frame MACs and mutual TLS (docs/security.md)."""
