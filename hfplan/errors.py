"""User-facing errors: the CLI turns these into one line on stderr and exit code 2."""

from pydantic import ValidationError


class HfplanError(Exception):
    """Bad input or an impossible request, explained in one line for the user."""


def known_names(names) -> str:
    """Format a list of valid names for an error message."""
    return ", ".join(sorted(names))


def describe_validation_error(error: ValidationError) -> str:
    """The first pydantic error as one line naming the field: `field a.b: message, got 'x'`. A check across
    fields names its fields in its own message, which is shown as it is."""
    first = error.errors()[0]
    message = first["msg"].removeprefix("Value error, ")
    value = first.get("input")
    if first["type"] != "value_error" and isinstance(value, str | int | float | bool) and len(repr(value)) < 40:
        message += f", got {value!r}"
    extra = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    where = ".".join(str(part) for part in first["loc"])
    return (f"field {where}: {message}" if where else message) + extra
