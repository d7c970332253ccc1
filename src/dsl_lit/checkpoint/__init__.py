"""Checkpoint directories, retention and resume."""
