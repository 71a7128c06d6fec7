"""Numbered migration modules: ``vNNNN_<name>.py`` each defining ``MIGRATION``."""
