"""``cupy.fft``: NumPy's functions, which run on SimArray operands where the sim has them."""

from __future__ import annotations

from typing import Any

import numpy as np


def __getattr__(name: str) -> Any:
    return getattr(np.fft, name)
