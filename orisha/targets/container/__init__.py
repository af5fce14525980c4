"""The FROM-scratch container target: ``build`` (packager) and ``runtime`` (entry point)."""
