"""collector."""
