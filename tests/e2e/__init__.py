"""End-to-end tests: recipe runs in subprocesses, multi-process runs over gloo, and the GPU checks."""
