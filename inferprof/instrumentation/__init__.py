"""instrumentation."""
