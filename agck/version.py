"""The package version, in a module of its own so any layer can read it without
importing the public face (and so the build reads it without importing agck)."""

__version__ = "0.2.0"
