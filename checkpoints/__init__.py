"""Checkpoint tools (tiny checkpoint generator and friends); ``from checkpoints.make_tiny import make_tiny``."""
