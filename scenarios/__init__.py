"""Runnable scenario files (TOML) and the small offline domains they name."""
