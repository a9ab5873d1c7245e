"""kvpolicy."""
__version__ = "0.1.0"


def new_list() -> list:  # type: ignore[type-arg]
    """A new empty list, as a pydantic `default_factory`: pydantic inspects a factory's signature when it builds
    a model, and for the builtin `list` that means parsing its text signature (slow at start-up)."""
    return []


def new_dict() -> dict:  # type: ignore[type-arg]
    """A new empty dict, as a pydantic `default_factory` (see `new_list`)."""
    return {}


def noun(count: object, singular: str, plural: str | None = None) -> str:
    """`singular` for a count of 1, else `plural` (default: singular + "s"): "1 request", "3 requests"."""
    return singular if count == 1 and not isinstance(count, bool) else plural or singular + "s"
