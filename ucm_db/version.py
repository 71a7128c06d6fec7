"""The ucm-db release (one place; ``ucm_db.__version__`` re-exports it). A leaf
module, so code below the package (format records, archives, migrations) can
name the version without importing ``ucm_db`` itself."""

__version__ = "0.1.0"
