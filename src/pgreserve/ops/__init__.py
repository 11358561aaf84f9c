"""Operating pgreserve: hold-time sampling, bloat and vacuum health, metrics, doctor, reconcile."""
