"""The structure: import directions, the one hook, the source tree's rules."""
