"""Layouts over several gloo processes, held to one process's numbers."""
