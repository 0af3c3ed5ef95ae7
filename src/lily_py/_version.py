"""The package version (pyproject.toml's), in a module of its own so that any module can
import it without importing the package's ``__init__``."""
__version__ = "0.1.0"
