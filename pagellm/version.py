"""pagellm's version, in one place (the package metadata and the server read it)."""

__version__ = "0.1.0"
