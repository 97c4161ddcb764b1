"""Deployment entry points for the zephon-ray data service (see README.md): scripts for ``ray job submit``."""
