"""User-facing errors: the CLI turns these into one line on stderr and exit code 2."""

from pydantic import ValidationError


class HfplanError(Exception):
    """Bad input or an impossible request, explained in one line for the user."""


def known_names(names) -> str:
    """Format a list of valid names for an error message."""
    return ", ".join(sorted(names))


def describe_validation_error(error: ValidationError) -> str:
    """The first pydantic error as one line naming the field: `field a.b: message`."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "(top level)"
    extra = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"field {where}: {first['msg']}{extra}"
