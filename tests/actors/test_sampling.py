"""The one place that decides whether a backend can honour a sampling field."""

from __future__ import annotations

import pytest

from pool.actors.serving._intake import check_sampling
from pool.backends import Capabilities, Decoding
from pool.errors import PoolError


def test_a_field_the_backend_lacks_is_a_400_naming_it() -> None:
    caps = Capabilities(sampling=frozenset({"seed"}))
    check_sampling("m", Decoding(seed=3), caps)
    check_sampling("m", Decoding(), Capabilities())
    with pytest.raises(PoolError) as refused:
        check_sampling("m", Decoding(seed=3, logit_bias=((1, 2.0),)), caps)
    assert refused.value.code == "sampling_unsupported" and refused.value.status == 400
    assert refused.value.details == {"param": "logit_bias"}
