"""The translator families. Importing this package registers every one in `FAMILIES` (name → class)."""

from ..translator import FAMILIES  # noqa: F401  (filled by the @family classes below)
from . import crosslayer, headwise, residual  # noqa: F401
