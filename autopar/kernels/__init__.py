"""kernels stage (see docs/INTERFACES.md)."""
