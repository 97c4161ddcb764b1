"""Integrations on top of the core and the stream layer: TorchTitan and Ray Train."""
