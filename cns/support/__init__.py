"""Helpers every layer may use: structlog set-up, fault injection for tests, plain-text tables."""
