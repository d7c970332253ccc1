"""Tests of ``posttrain``."""
