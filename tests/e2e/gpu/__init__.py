"""Tests that need a CUDA GPU (skipped elsewhere), and the check script that runs them."""
