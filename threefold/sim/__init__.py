"""Calibrated discrete-event simulator of replicas behind the router (pure Python + numpy)."""
