"""report stage (see docs/INTERFACES.md)."""
