"""The package version, as workers and logs report it."""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    PACKAGE_VERSION = _version("evobus")
except PackageNotFoundError:  # running from a checkout that was never installed
    PACKAGE_VERSION = "0+unknown"
