"""Small helpers shared across packages."""
