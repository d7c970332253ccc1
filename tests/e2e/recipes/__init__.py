"""The recipes run as a user runs them, in subprocesses."""
