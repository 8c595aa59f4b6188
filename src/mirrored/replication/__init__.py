"""Keeping replicas identical: mirrored modules and optimizers, gradient reduction, ZeRO."""
